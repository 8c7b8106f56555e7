"""The infra tests' synthesized stacks, shared here: the evaluator is checked against the template's own policies."""

from tests.infra.conftest import custom_synth, default_synth

__all__ = ["custom_synth", "default_synth"]
