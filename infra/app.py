"""The CDK app (`python -m infra.app`, see cdk.json): the spotcr stack, checked by cdk-nag on every synth."""

from __future__ import annotations

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from infra.settings import Settings
from infra.stack import SpotcrStack


def build_app(app: cdk.App | None = None) -> tuple[cdk.App, SpotcrStack]:
    app = app or cdk.App()
    settings = Settings.from_context(app.node)
    stack = SpotcrStack(app, "Spotcr", settings=settings)
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return app, stack


def main() -> None:
    app, _ = build_app()
    app.synth()


if __name__ == "__main__":
    main()
