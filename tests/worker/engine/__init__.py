"""Tests of worker/engine/."""
