"""Host time per call of each op: tiny tensors, so the GPU waits on the host and the time is the
dispatcher's, the launch path's and (with a backward) the autograd engine's. For changes to the launch
path (src/kernels.rs, src/ffi.rs, src/torch/op.h), compared build against build.

    python benches/bench_host.py [label]     # forward, and forward + torch.autograd.grad, per op (µs)

Median of 7 trials of 2000 calls between two synchronisations, after 50 warm-up calls.
"""
import statistics
import sys
import time

import torch

import bastile  # noqa: F401  (loads torch.ops.bastile)


def per_call(fn, n=2000, trials=7):
    for _ in range(50):
        fn()
    times = []
    for _ in range(trials):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else "bastile"
    d, bf = "cuda", torch.bfloat16
    leaf = lambda *shape: torch.randn(*shape, device=d, dtype=bf, requires_grad=True)
    x, w, g, u = leaf(8, 1024), leaf(1024), leaf(8, 1024), leaf(8, 1024)
    q, k, qw, kw = leaf(1, 8, 4, 128), leaf(1, 8, 2, 128), leaf(128), leaf(128)
    cos, sin = torch.randn(1, 8, 128, device=d, dtype=bf), torch.randn(1, 8, 128, device=d, dtype=bf)
    ops = {
        "rms_norm": (lambda: torch.ops.bastile.rms_norm(x, w, 1e-6), (x, w)),
        "swiglu": (lambda: torch.ops.bastile.swiglu(g, u), (g, u)),
        "rope": (lambda: torch.ops.bastile.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 1), (q, k)),
        "qk_norm_rope": (lambda: torch.ops.bastile.qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6), (q, k, qw, kw)),
    }
    for name, (f, inputs) in ops.items():
        def fwd_bwd():
            out = f()
            out = out if isinstance(out, tuple) else (out,)
            torch.autograd.grad(out, inputs, [torch.ones_like(o) for o in out])
        with torch.no_grad():
            fwd = per_call(f)
        print(f"{label} {name}: forward {fwd:.2f} us, forward+backward {per_call(fwd_bwd):.2f} us", flush=True)


if __name__ == "__main__":
    main()
