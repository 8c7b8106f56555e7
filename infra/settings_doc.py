"""Writes docs/settings.md from the settings models: `python -m infra.settings_doc > docs/settings.md`."""

from __future__ import annotations

from spotcr_contracts import settings as function_settings

from infra import settings as deploy_settings

HEADER = """# Settings

Generated from the code by `python -m infra.settings_doc > docs/settings.md`; a test fails when this page and the
code differ.

## Deployment options

CDK context options: `cdk deploy -c option=value` (a list: comma-separated or JSON), or `context` in cdk.json.
Each is checked at synth (`infra/settings.py`); a bad value stops the synth with a message naming the option.

| option | default | meaning |
|---|---|---|
"""

FUNCTIONS = """
## Function environment

What the stack sets in every Lambda function's environment, and the functions read once at their edge
(`spotcr_contracts/settings.py`). Users set none of them: they follow from the deployment options and the stack's
resources. A missing or bad value fails the function with a message naming the variable.

| variable | type | default | meaning |
|---|---|---|---|
"""

VM = """
## Job VM boot

What the stack puts in each job VM's user data (`vm-bootstrap/bootstrap.sh`'s placeholders), and the boot passes on
to `spotcr-agent bootstrap`, which writes it into the agent's `/etc/spotcr/agent.json`
(`spotcr_contracts/settings.py`, `VmSettings`). An empty value means "not used".

| placeholder | agent option | meaning |
|---|---|---|
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    lines = [HEADER]
    lines += [
        f"| `{name}` | {_cell(default)} | {_cell(meaning)} |\n"
        for name, default, meaning in deploy_settings.reference()
    ]
    lines.append(FUNCTIONS)
    lines += [
        f"| `{name}` | {kind} | {_cell(default)} | {_cell(meaning)} |\n"
        for name, kind, default, meaning in function_settings.reference()
    ]
    lines.append(VM)
    lines += [
        f"| `{name}` | {f'`{flag}`' if flag else 'none'} | {_cell(meaning)} |\n"
        for name, flag, meaning in function_settings.vm_reference()
    ]
    return "".join(lines)


if __name__ == "__main__":
    print(render(), end="")
