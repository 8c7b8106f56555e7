"""A small CUDA job for make test-gpu and make bench ARGS=gpu: its state lives in GPU device memory.

Usage: gpu_train.py STEPS STEP_SECONDS [DEVICE_MIB]
Writes one line per step to progress.log in its working directory and prints a digest of its final state, the
same for every uninterrupted run. With PyTorch (when this interpreter has it): a small deterministic training
loop, plus DEVICE_MIB of device memory it keeps changing. Without: the CUDA driver API through ctypes
(libcuda.so.1), DEVICE_MIB of device memory that each step rewrites from what the device held.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import time
from pathlib import Path

MIB = 1 << 20


def _log(line: str) -> None:
    with Path("progress.log").open("a") as progress:
        progress.write(line + "\n")


def torch_job(steps: int, step_s: float, mib: int) -> str:
    import os

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda")
    held = torch.zeros(mib * MIB // 4, dtype=torch.int32, device=device)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator(device=device).manual_seed(1)
    for step in range(steps):
        x = torch.randn(1024, 256, device=device, generator=data)
        y = torch.randint(0, 10, (1024,), device=device, generator=data)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        held.add_(1)
        _log(f"{step} {loss.item():.8f}")
        time.sleep(step_s)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    digest = hashlib.sha256(bytes(weights.view(torch.uint8).tolist())).hexdigest()
    intact = bool(torch.all(held == steps).item()) if mib else True
    return f"weights {digest} held-memory {'intact' if intact else 'CHANGED'}"


class _Cuda:
    """The few CUDA driver API calls the ctypes job makes; any error ends the job naming the call."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            raise SystemExit(f"no NVIDIA driver here: cannot load libcuda.so.1 ({error})") from error

    def __call__(self, name: str, *args: object) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise SystemExit(f"{name} failed with CUDA error {code}")


def ctypes_job(steps: int, step_s: float, mib: int) -> str:
    cuda = _Cuda()
    cuda("cuInit", 0)
    device, context, pointer = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    cuda("cuDeviceGet", ctypes.byref(device), 0)
    cuda("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
    cuda("cuCtxSetCurrent", context)
    blocks = max(mib, 1)
    cuda("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(blocks * MIB))
    cuda("cuMemsetD8_v2", pointer, ctypes.c_ubyte(0), ctypes.c_size_t(blocks * MIB))
    block = ctypes.create_string_buffer(MIB)
    for step in range(steps):
        source, target = pointer.value + (step % blocks) * MIB, pointer.value + ((step + 1) % blocks) * MIB
        cuda("cuMemcpyDtoH_v2", block, ctypes.c_uint64(source), ctypes.c_size_t(MIB))
        digest = hashlib.sha256(block.raw + step.to_bytes(8, "little")).digest()
        ctypes.memmove(block, digest * (MIB // len(digest)), MIB)
        cuda("cuMemcpyHtoD_v2", ctypes.c_uint64(target), block, ctypes.c_size_t(MIB))
        _log(f"{step} {digest.hex()}")
        time.sleep(step_s)
    whole = hashlib.sha256()
    for index in range(blocks):
        cuda("cuMemcpyDtoH_v2", block, ctypes.c_uint64(pointer.value + index * MIB), ctypes.c_size_t(MIB))
        whole.update(block.raw)
    return f"device {whole.hexdigest()}"


def main(argv: list[str]) -> int:
    steps, step_s = int(argv[0]), float(argv[1])
    mib = int(argv[2]) if len(argv) > 2 else 0
    try:
        import torch  # noqa: F401
    except ImportError:
        print(ctypes_job(steps, step_s, mib), flush=True)
    else:
        print(torch_job(steps, step_s, mib), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
