"""PyTorch anchor for apps/src/mlp_shapes: the same MLP (784-256-10, relu, softmax), a batch from 1
to 64 a step, 500 steps, run eagerly and through torch.compile's CUDA-graph backend
(`backend="cudagraphs"`, the graph trees of `mode="reduce-overhead"` without Inductor's kernel
generation), one graph per batch size. Two measures, as the app's: a whole step (upload from a
pageable host tensor, forward, download, wait) and the forward pass alone (500 passes queued, then
one wait). Prints a markdown table of medians over ROUNDS rounds.

    python3 benches/pytorch/mlp_shapes.py [ROUNDS]
"""
import statistics
import sys
import time

import torch

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 9
IN, HIDDEN, CLASSES, STEPS, MAX_BATCH = 784, 256, 10, 500, 64

torch.manual_seed(0)
dev = torch.device("cuda")
w1 = torch.randn(IN, HIDDEN, device=dev) * (3.0 / IN) ** 0.5
b1 = torch.randn(HIDDEN, device=dev) * 0.1
w2 = torch.randn(HIDDEN, CLASSES, device=dev) * (3.0 / HIDDEN) ** 0.5
b2 = torch.randn(CLASSES, device=dev) * 0.5
gen = torch.Generator().manual_seed(1)
batches = [int(b) for b in torch.randint(1, MAX_BATCH + 1, (STEPS,), generator=gen)]
inputs = [torch.randn(b, IN, generator=gen) for b in batches]


def forward(x):
    h = torch.relu(x @ w1 + b1)
    return torch.softmax(h @ w2 + b2, dim=1)


torch._dynamo.config.cache_size_limit = 128
torch._dynamo.config.recompile_limit = 128
TWINS = {
    "torch_eager": forward,
    # A graph per batch size, Dynamo compiling each size apart (64 cache entries, guards checked
    # in turn). With automatic dynamic shapes instead, PyTorch 2.11's cudagraphs backend fails
    # on this workload ("The size of tensor a (44) must match the size of tensor b (13)").
    "torch_cudagraphs": torch.compile(forward, backend="cudagraphs", dynamic=False),
}
try:
    import triton  # noqa: F401  (Inductor's kernels need it)

    TWINS["torch_reduce_overhead"] = torch.compile(forward, mode="reduce-overhead")
except ImportError:
    print("no triton: mode=\"reduce-overhead\" (Inductor) not run")


def step(f, x_host):
    x = x_host.to(dev)
    p = f(x)
    return p.cpu()


with torch.no_grad():
    start = time.time()
    for f in TWINS.values():  # warm-up: every batch size compiled and recorded
        for _ in range(3):
            for x in inputs:
                step(f, x)
    torch.cuda.synchronize()
    print(f"warm-up (compiling and recording every batch size): {time.time() - start:.1f} s")
    worst = max(
        (step(f, x) - step(forward, x)).abs().max().item()
        for f in TWINS.values()
        for x in inputs[:64]
    )
    print(f"largest difference between the twins: {worst:.2e}")
    dev_inputs = {b: torch.randn(b, IN, device=dev) for b in set(batches)}
    results = {name: ([], [], []) for name in TWINS}
    for r in range(ROUNDS):
        for name, f in TWINS.items():
            t0 = time.perf_counter()
            for x in inputs:
                step(f, x)
            results[name][0].append((time.perf_counter() - t0) * 1e6 / STEPS)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for b in batches:
                f(dev_inputs[b])
            queued = time.perf_counter() - t0
            torch.cuda.synchronize()
            whole = time.perf_counter() - t0
            results[name][1].append(queued * 1e6 / STEPS)
            results[name][2].append(whole * 1e6 / STEPS)
    print(f"memory reserved by PyTorch's allocator: {torch.cuda.memory_reserved() / 2**20:.1f} MiB")
    print(f"\nmlp_shapes, PyTorch {torch.__version__} ({ROUNDS} rounds, medians):")
    print("| twin | step µs | forward: host µs to queue | forward µs with the wait |")
    print("|---|---|---|---|")
    for name, (s, q, w) in results.items():
        print(
            f"| {name} | {statistics.median(s):.2f} | {statistics.median(q):.2f} | "
            f"{statistics.median(w):.2f} |"
        )
