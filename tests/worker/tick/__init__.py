"""Tests of worker/tick/."""
