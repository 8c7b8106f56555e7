"""docs/reliability.md, generated from the tests that carry each claim.

A test backs a claim with `@pytest.mark.claim("<claim>")`; a module backs it in every test with
`pytestmark = pytest.mark.claim("<claim>")` (or inside a `pytestmark` list). The claims and what each one means are
CLAIMS below, in the page's order. The tests are read with `ast`, never imported, so a rename moves the page with
it and a test that no longer exists leaves it.

    python -m tests.claims            # writes docs/reliability.md
    python -m tests.claims --check    # exits 1 when the checked-in page differs
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGE = REPO_ROOT / "docs" / "reliability.md"
FAULT_SUITE = "tests/faults"

CLAIMS: dict[str, str] = {
    "At most one live copy": (
        "An older checkpoint is restored only once the old copy is known dead. A final dump that fails (store,"
        " scratch, CRIU) makes the agent kill the job and confirm it; otherwise the restore waits for EC2 to say the"
        " primary is stopped or terminated. Every fault scenario samples the job's processes across VMs every 50 ms."
    ),
    "The result equals an uninterrupted run's": (
        "A job interrupted and restored, once or more, ends with the same result as a run that was never"
        " interrupted, compared byte for byte."
    ),
    "Never a partial checkpoint": (
        "A checkpoint exists once its manifest is written, and the manifest is written last. An agent killed in the"
        " middle of an upload loses only that checkpoint."
    ),
    "Restore walks back past damaged checkpoints": (
        "A restore tries every committed checkpoint, newest first, retries store errors that may pass, and skips"
        " damaged, missing or incompatible ones."
    ),
    "A lazy restore never lets the job read a page that did not arrive": (
        "A job restored lazily runs before its memory has arrived; a page reaches it only from a chunk verified"
        " against the manifest. When a fetch fails or a chunk is corrupt while it runs, the job is killed and seen"
        " gone before the lazy-pages daemon stops (a closed userfaultfd would fill its memory with zeros), and the"
        " walk goes on; a final dump waits for the last page."
    ),
    "A mount the backup lacks ends in a start from scratch, not FAILED": (
        "A checkpoint records the VM mounts the job saw. A restore on a VM that lacks one (a mount made by the"
        " instance's own boot script, which backups do not run) skips it, naming the mount (`MissingMount`, or"
        " CRIU's `mnt: No mapping for ... mountpoint`). Backups all boot alike, so such checkpoints count as not"
        " restorable: the walk ends in a start from the beginning where `spotcr:restart-from-scratch` allows it."
    ),
    "Only spotcr's own word moves a job": (
        "An instance tagged `spotcr:mode=restore` that the job's record does not name as its backup gets"
        " `spotcr:error`. `AgentReady` and `BootstrapFailed` move a job only with its run id (the agent's"
        " `BootstrapFailed` waits up to 120 s for its `spotcr:run`)."
    ),
    "A status command after the end answers at once": (
        "The store-credentials URL answers 410 for an ended job, and the agent never asks again."
    ),
    "A run's store session reaches nothing of an earlier run's result": (
        "The store session vended to a run is narrowed to that run's prefix; of the job name's other runs it reaches"
        " only the checkpoint state a new run prunes, never their results."
    ),
    "A store outage fails a dump, not the job": (
        "A periodic dump that cannot reach the store fails alone; the job runs on."
    ),
    "Exactly one end": (
        "A job that exits, with any code, is recorded COMPLETED or FAILED exactly once: exits racing a dump order,"
        " right after the restore, just before the warning, and during the final dump."
    ),
    "Duplicated and reordered events recover once": (
        "EventBridge delivers at least once and in any order: duplicated and reordered warnings start one recovery."
    ),
    "Backups are first-class": (
        "A backup warned or lost while it restores, or right after, starts a new cycle at the next generation from"
        " the newest checkpoint."
    ),
    "Garbage collection never loses a committed checkpoint": (
        "A commit and a prune racing each other, the interleaving forced: no committed checkpoint loses a chunk."
    ),
    "Nothing left allocated": (
        "A leak check ends every end-to-end run and fault scenario: nothing spotcr allocated (a backup VM, a volume, a"
        " snapshot, an EFS access point, an SSM command still running) is left 30 s after the job finished."
    ),
    "One identity per run": (
        "Each registration mints a run id; a second instance with the name of a job that runs elsewhere never starts"
        " it, and a job name run again never sees the earlier run's checkpoints. The earlier run's result stays its"
        " own."
    ),
    "Old runs are pruned, never under a commit": (
        "The VM that starts a new run of a job name deletes the earlier runs' checkpoints, never under a late commit,"
        " and keeps their results. End to end, the new run's primary vanishes at once and its backup prunes the"
        " earlier run."
    ),
    "Facts come from authenticated sources": (
        "A checkpoint, a restore and a job's exit are taken from SSM's result of the command on the instance, never"
        " from the bus. A forged RestoreCompleted or JobExited moves nothing; a lost status-change event still ends"
        " with the restore taken and the backup kept; a restore still running at the timeout is waited for; an"
        " undeliverable command fails the attempt; a lost exit confirmation is asked again by the scheduler; an"
        " instance gone before it answers gets the job's normal recovery from its newest checkpoint. A real exit ends"
        " the job once even when SSM's status-change event comes twice, and the rehearsal's event is shaped as AWS's"
        " sample. End to end, a forged JobExited on the bus while the job runs makes the control plane ask the"
        " instance, and the job runs on to the uninterrupted result."
    ),
    "Attempts and order": (
        "A duplicated restore failure never completes the next attempt, and a resent event is handled once. Which"
        " checkpoint is newest never depends on VM clocks (a backup 120 s behind, a clock that jumps backwards), and"
        " a final dump that outlives its wait is never recorded. End to end, the backup's agent runs with its wall"
        " clock 120 s behind (`time.time` shifted by a `sitecustomize` in that VM's own `/opt/spotcr`; libfaketime,"
        " used before, hung the agent's handshake with CRIU's post-dump script in about 1 run in 5)."
    ),
}


class ClaimError(ValueError):
    """A claim marker names no known claim, or a known claim has no test."""


@dataclass(frozen=True)
class Backing:
    """One test, or one whole module when `test` is empty, backing a claim."""

    module: str
    test: str = ""

    def __str__(self) -> str:
        return f"`{self.module}::{self.test}`" if self.test else f"`{self.module}` (every test)"


def _claims_of(node: ast.expr) -> list[str]:
    """The claims named by `pytest.mark.claim("...")` calls anywhere in an expression."""
    found = []
    for call in ast.walk(node):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "claim"
            and isinstance(call.func.value, ast.Attribute)
            and call.func.value.attr == "mark"
        ):
            if (
                len(call.args) != 1
                or not isinstance(call.args[0], ast.Constant)
                or not isinstance(call.args[0].value, str)
            ):
                raise ClaimError(f"line {call.lineno}: pytest.mark.claim takes one string, the claim")
            found.append(call.args[0].value)
    return found


def _tests_in(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    functions = []
    for node in tree.body:
        bodies = node.body if isinstance(node, ast.ClassDef) else [node]
        functions += [f for f in bodies if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    return [f for f in functions if f.name.startswith("test_")]


def collect(root: Path = REPO_ROOT) -> dict[str, list[Backing]]:
    """Each claim of CLAIMS with the tests that back it, read from tests/**/test_*.py under root."""
    backed: dict[str, list[Backing]] = {claim: [] for claim in CLAIMS}
    for path in sorted((root / "tests").rglob("test_*.py")):
        module = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=module)
        found: list[tuple[str, Backing, int]] = []
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
            ):
                found += [(claim, Backing(module), node.lineno) for claim in _claims_of(node.value)]
        for test in _tests_in(tree):
            for decorator in test.decorator_list:
                found += [(claim, Backing(module, test.name), test.lineno) for claim in _claims_of(decorator)]
        for claim, backing, line in found:
            if claim not in backed:
                raise ClaimError(f"{module}:{line}: no claim {claim!r} in tests/claims.py's CLAIMS")
            backed[claim].append(backing)
    if unbacked := [claim for claim, backings in backed.items() if not backings]:
        raise ClaimError(f"claims no test backs (mark one, or drop the claim): {unbacked}")
    return backed


def fault_scenarios(root: Path = REPO_ROOT) -> int:
    """How many scenarios the fault suite has: its test functions."""
    return sum(len(_tests_in(ast.parse(p.read_text()))) for p in sorted((root / FAULT_SUITE).glob("test_*.py")))


def render(root: Path = REPO_ROOT) -> str:
    lines = [
        "# Reliability",
        "",
        "<!-- Generated by `python -m tests.claims` from the tests' `claim` markers: do not edit by hand. -->",
        "",
        "Each claim spotcr makes, and the tests that back it. A test backs a claim with",
        '`@pytest.mark.claim("...")`; a module backs it in every test with `pytestmark`. The claims are listed in',
        "`tests/claims.py`; a test fails when this page differs from what the markers say.",
        "",
        f"The fault suite (`{FAULT_SUITE}`, marker `faults`) has {fault_scenarios(root)} scenarios. Each runs the"
        " rehearsal with one injected fault and asserts the result (or the reason the job failed), at most one live"
        " copy, a final job record and nothing left allocated: see [testing.md](testing.md#the-fault-suite).",
    ]
    for claim, backings in collect(root).items():
        lines += ["", f"## {claim}", "", CLAIMS[claim], ""]
        lines += [f"- {backing}" for backing in backings]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv == ["--check"]:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(REPO_ROOT)} is out of date: run python -m tests.claims", file=sys.stderr)
            return 1
        return 0
    if argv:
        print("usage: python -m tests.claims [--check]", file=sys.stderr)
        return 2
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
