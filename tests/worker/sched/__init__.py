"""Tests of worker/sched/."""
