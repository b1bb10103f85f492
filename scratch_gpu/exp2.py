"""GPU experiment 2: our JAX decoding's one-row products. Variants (each its own model):
current: as shipped; percall: kernels cast inside the loop (before the precast change);
transposed: kernels held (N, W), multiplied as x @ kt.T (a row reduction for XLA's one-row dots);
rows2: one-row products computed on two rows (the row repeated), a GEMM rather than multiply+reduce;
nocb: without the command-buffer options."""
import json, os, pathlib, statistics, sys, time
os.environ["KERAS_BACKEND"] = "jax"
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
import numpy as np
import jax
import keras
from keras import ops
import keras_hub
import keras_attention.backend.jax as kj
from keras_attention.backend import compiled_steps as cs
from keras_attention.models import Seq2SeqTransformer
from seq2seq_speed import _interleaved, bart_runner, our_runner

OUT = pathlib.Path(os.environ.get("OUT", "/tmp"))
OPTIONS = {}
_jit = jax.jit
def jit(f, **kw):
    if getattr(f, "__name__", "") == "stateless" and OPTIONS.get("set"):
        kw["compiler_options"] = dict(OPTIONS["set"])
    return _jit(f, **kw)
class J:
    def __getattr__(self, n):
        return getattr(jax, n)
J.jit = staticmethod(jit)
kj.jax = J()

Orig = cs._Projection
orig_block_init = cs._BlockStep.__init__
orig_project = cs._BlockStep._project

class PerCall(Orig):
    @classmethod
    def of(cls, dense, width):
        p = cls(None, None, dense.compute_dtype)
        p.dense, p.width = dense, width
        return p
    @classmethod
    def joined(cls, projections):  # the fused QKV kernel was cast before the loop already
        return Orig.joined([Orig.of(p.dense, p.width) for p in projections])
    def __call__(self, x):
        d = self.dense
        out = ops.matmul(ops.cast(x, self.dtype), ops.cast(ops.reshape(d.kernel, (-1, self.width)), self.dtype))
        return out if d.bias is None else out + ops.cast(ops.reshape(d.bias, (-1,)), self.dtype)

def _barrier(x):
    return jax.lax.optimization_barrier(x)

class Transposed(Orig):
    def __init__(self, kernel, bias, dtype):
        super().__init__(kernel, bias, dtype)
        self.kernel_t = _barrier(ops.transpose(kernel))  # (N, W)
    def __call__(self, x):
        out = ops.einsum("...w,nw->...n", ops.cast(x, self.dtype), self.kernel_t)
        return out if self.bias is None else out + self.bias

def transposed_init(self, block):
    orig_block_init(self, block)
    self.qkv_kernel_t = _barrier(ops.transpose(self.qkv.kernel))
def transposed_project(self, h):
    h = ops.cast(h, self.qkv.dtype)
    qkv = ops.einsum("...w,nw->...n", h, self.qkv_kernel_t)
    if self.qkv.bias is not None:
        qkv = qkv + self.qkv.bias
    qw, kw_ = self.heads * self.head_size, self.kv_heads * self.head_size
    q, k, v = ops.split(qkv, [qw, qw + kw_], axis=-1)
    b = ops.shape(h)[0]
    return (ops.reshape(q, (b, 1, self.heads, self.head_size)),
            ops.reshape(k, (b, 1, self.kv_heads, self.head_size)), ops.reshape(v, (b, 1, self.kv_heads, self.head_size)))

def _two_rows(x, f):
    if x.shape[0] != 1:
        return f(x)
    return f(ops.concatenate([x, x], axis=0))[:1]
class Rows2(Orig):
    def __call__(self, x):
        return _two_rows(x, super().__call__)
def rows2_project(self, h):
    if h.shape[0] != 1:
        return orig_project(self, h)
    q, k, v = orig_project(self, ops.concatenate([h, h], axis=0))
    return q[:1], k[:1], v[:1]

import keras_attention.backend.jax as _kj
_ORIG_EMBED = _kj._weights_to_embed

def patch(name):
    # "embed": the weights compiled in as constants on the GPU too (one-row loops).
    _kj._weights_to_embed = (lambda values: True) if name == "embed" else _ORIG_EMBED
    cs._Projection = {"percall": PerCall, "transposed": Transposed, "rows2": Rows2}.get(name, Orig)
    cs._BlockStep.__init__ = transposed_init if name == "transposed" else orig_block_init
    cs._BlockStep._project = {"transposed": transposed_project, "rows2": rows2_project}.get(name, orig_project)
    OPTIONS["set"] = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"} if name == "nocb" else None

if os.environ.get("F32") is None:
    keras.config.set_dtype_policy("mixed_bfloat16")
V, L, H, D, F, MAXLEN = [int(x) for x in os.environ.get("SIZE", "8000,6,8,512,2048,96").split(",")]
backbone = keras_hub.models.BartBackbone(vocabulary_size=V, num_layers=L, num_heads=H, hidden_dim=D,
    intermediate_dim=F, dropout=0.0, max_sequence_length=MAXLEN)
VARIANTS = os.environ.get("VARIANTS", "current,embed,percall,transposed,rows2,nocb").split(",")
models = {name: Seq2SeqTransformer.from_keras_hub(backbone) for name in VARIANTS}
samplers = {"greedy": keras_hub.samplers.GreedySampler, "beam": lambda: keras_hub.samplers.BeamSampler(num_beams=4)}
rows = [(s, int(b)) for s, b in (r.split(":") for r in os.environ.get("ROWS", "greedy:1,beam:1,greedy:32").split(","))]
rng = np.random.default_rng(1)
NEW = 32
results = []
for sampling, batch in rows:
    source = rng.integers(3, V, (batch, MAXLEN // 2)).astype("int32")
    mask = np.ones_like(source, bool)
    outputs, runners = {}, {}
    for name in VARIANTS:
        patch(name)
        for tag, n in (("", NEW), ("_short", 1)):
            r = our_runner(models[name], source, mask, n, sampling, outputs, name + tag)
            t0 = time.perf_counter()
            try:
                r(); r()
            except Exception as e:
                print(json.dumps({"variant": name, "error": repr(e)[:800]}), flush=True)
                break
            print(json.dumps({"compiled": name + tag, "sampling": sampling, "batch": batch, "s": round(time.perf_counter() - t0, 1)}), flush=True)
            runners[name + tag] = r
    patch("current")
    bart = keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None)
    bart.compile(sampler=samplers[sampling]())
    for tag, n in (("", NEW), ("_short", 1)):
        runners["kh" + tag] = bart_runner(bart, source, mask, n, outputs, "kh" + tag)
    runners = {k: v for k, v in runners.items() if k + "_short" in runners or (k.endswith("_short") and k[:-6] in runners)}
    medians, times = _interleaved(runners, int(os.environ.get("REPEATS", 7)), rounds=True)
    names = [n for n in runners if not n.endswith("_short")]
    row = {"sampling": sampling, "batch": batch,
           "ms_per_token": {n: round(1e3 * medians[n] / NEW, 4) for n in names},
           "marginal": {n: round(1e3 * statistics.median(a - b for a, b in zip(times[n], times[n + "_short"])) / (NEW - 1), 4) for n in names},
           "ratio": {n: round(medians["kh"] / medians[n], 3) for n in names if n != "kh"},
           "same": {n: bool(np.array_equal(np.asarray(outputs[n]), np.asarray(outputs["kh"]))) for n in names if n != "kh"}}
    print(json.dumps(row), flush=True)
    results.append(row)
    (OUT / "exp2.json").write_text(json.dumps(results, indent=1))
