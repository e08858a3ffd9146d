"""Tests of worker/cache/."""
