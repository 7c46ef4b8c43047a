import sys, time, jax, jax.numpy as jnp, numpy as np, jaxtrace as jt
sys.path.insert(0, "benchmarks")
from models import mlp
m = mlp()
loss = lambda p, x: m.loss(p, x, jt.tag)
params = jax.tree_util.tree_map(jnp.asarray, m.params); x = jnp.asarray(m.x)
vg = jax.jit(jt.value_and_grad(loss))
nf = jax.jit(jt.find_nonfinite(loss))
jax.block_until_ready(vg(params, x)); jax.block_until_ready(nf(params, x))
ta, tb = [], []
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 30):
    for f, t in ((vg, ta), (nf, tb)) if r % 2 else ((nf, tb), (vg, ta)):
        t0 = time.perf_counter()
        for _ in range(10): out = f(params, x)
        jax.block_until_ready(out)
        t.append((time.perf_counter() - t0) / 10)
print(m.describe, jax.__version__)
print("value_and_grad %.3f ms  find_nonfinite %.3f ms  ratio(median) %.3f  ratio(min) %.3f" % (np.median(ta)*1e3, np.median(tb)*1e3, np.median(tb)/np.median(ta), min(tb)/min(ta)))
