"""Tests of worker/io/."""
