"""Per-node time of one MNIST training update (in-plan profiling): python bench/profile_step.py [fc|cnn] [threads]."""
import time, collections, sys
import numpy as np
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models import mnist as model
from ggtrain.core.train import ClassifierConfig, ClassifierRun
arch = sys.argv[1] if len(sys.argv) > 1 else "cnn"
nt = int(sys.argv[2]) if len(sys.argv) > 2 else 2
be = CpuBackend(nt)
run = ClassifierRun(lambda p, t: model.forward(arch, p, t), model.init_params(arch, 0), (28, 28), ClassifierConfig(epochs=1), be)
st = run.step
x = np.random.rand(500, 28, 28).astype(np.float32); y = np.random.randint(0, 10, 500).astype(np.int32)
st.step([{run.x: x, run.y: y}] * 2, 1e-3)
for plan in (st._micro, st._update): plan.plan.profile()
N = 5
t = time.perf_counter()
for _ in range(N): st.step([{run.x: x, run.y: y}] * 2, 1e-3)
step = (time.perf_counter() - t) / N
tot = collections.Counter()
for plan in (st._micro, st._update):
    for call, sec in zip(plan.plan.calls, plan.plan.node_seconds()):
        key = call.kernel + " " + "x".join(map(str, call.dst.shape)) + " <- " + ", ".join("x".join(map(str, s.shape)) + ("T" if len(s.strides) > 1 and s.strides[-1] != 1 else "") for s in call.srcs)
        tot[key] += sec / N
print(f"full update: {step*1e3:.1f} ms  -> epoch {step*57:.2f} s; sum of nodes {sum(tot.values())*1e3:.1f} ms")
for k, v in tot.most_common(22): print(f"{v*1e3:8.2f} ms  {k}")
