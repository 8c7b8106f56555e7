"""Tests of the local AWS (rehearsal/): its IAM evaluator and what it is fed."""
