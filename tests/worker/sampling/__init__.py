"""Tests of worker/sampling/."""
