"""The handler tests run on the same moto control plane as the workflow tests."""

from tests.workflow.conftest import aws_env, plane

__all__ = ["aws_env", "plane"]
