"""GPU experiment: our JAX decoding loop compiled with XLA command-buffer options, against KerasHub."""
import json, os, pathlib, statistics, sys, time
os.environ["KERAS_BACKEND"] = "jax"
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
import numpy as np
import jax
import keras
import keras_hub
import keras_attention.backend.jax as kj
from keras_attention.models import Seq2SeqTransformer
from seq2seq_speed import _interleaved, bart_runner, our_runner

OUT = pathlib.Path(os.environ.get("OUT", "/tmp"))
CURRENT = {}
_jit = jax.jit
def jit(f, **kw):
    if getattr(f, "__name__", "") == "stateless" and CURRENT:
        kw["compiler_options"] = dict(CURRENT)
    return _jit(f, **kw)
class J:
    def __getattr__(self, n):
        return getattr(jax, n)
J.jit = staticmethod(jit)
kj.jax = J()

keras.config.set_dtype_policy("mixed_bfloat16")
V, L, H, D, F, MAXLEN = 8000, 6, 8, 512, 2048, 96
backbone = keras_hub.models.BartBackbone(vocabulary_size=V, num_layers=L, num_heads=H, hidden_dim=D,
    intermediate_dim=F, dropout=0.0, max_sequence_length=MAXLEN)
ALL = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
VARIANTS = {
    "default": {},
    "cb_while": {"xla_gpu_enable_command_buffer": ALL + ",WHILE,CONDITIONAL"},
    "cb_while_min1": {"xla_gpu_enable_command_buffer": ALL + ",WHILE,CONDITIONAL", "xla_gpu_graph_min_graph_size": 1},
}
only = os.environ.get("VARIANTS")
if only:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in only.split(",")}
models = {}
for name, opts in VARIANTS.items():
    models[name] = Seq2SeqTransformer.from_keras_hub(backbone)
samplers = {"greedy": keras_hub.samplers.GreedySampler,
            "beam": lambda: keras_hub.samplers.BeamSampler(num_beams=4)}
rows = [(s, int(b)) for s, b in (r.split(":") for r in os.environ.get("ROWS", "greedy:1,beam:1,greedy:32,beam:32").split(","))]
rng = np.random.default_rng(1)
NEW = 32
results = []
for sampling, batch in rows:
    source = rng.integers(3, V, (batch, MAXLEN // 2)).astype("int32")
    mask = np.ones_like(source, bool)
    outputs, runners = {}, {}
    for name, opts in VARIANTS.items():
        CURRENT.clear(); CURRENT.update(opts)
        for tag, n in (("", NEW), ("_short", 1)):
            r = our_runner(models[name], source, mask, n, sampling, outputs, name + tag)
            t0 = time.perf_counter()
            try:
                r(); r()
            except Exception as e:
                print(json.dumps({"variant": name, "error": str(e)[:500]}), flush=True)
                break
            print(json.dumps({"compiled": name + tag, "sampling": sampling, "batch": batch, "s": round(time.perf_counter() - t0, 1)}), flush=True)
            runners[name + tag] = r
    CURRENT.clear()
    bart = keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None)
    bart.compile(sampler=samplers[sampling]())
    for tag, n in (("", NEW), ("_short", 1)):
        runners["kh" + tag] = bart_runner(bart, source, mask, n, outputs, "kh" + tag)
    medians, times = _interleaved(runners, int(os.environ.get("REPEATS", 7)), rounds=True)
    names = [n for n in runners if not n.endswith("_short")]
    row = {"sampling": sampling, "batch": batch,
           "ms_per_token": {n: round(1e3 * medians[n] / NEW, 4) for n in names},
           "marginal": {n: round(1e3 * statistics.median(a - b for a, b in zip(times[n], times[n + "_short"])) / (NEW - 1), 4) for n in names},
           "ratio": {n: round(medians["kh"] / medians[n], 3) for n in names if n != "kh"},
           "same": {n: bool(np.array_equal(np.asarray(outputs[n]), np.asarray(outputs["kh"]))) for n in names if n != "kh"}}
    print(json.dumps(row), flush=True)
    results.append(row)
    if os.environ.get("TRACE") and not results[:-1]:
        for n in [k for k in runners if not k.endswith("_short")]:
            with jax.profiler.trace(str(OUT / "trace" / n), create_perfetto_trace=True):
                runners[n]()
            print(json.dumps({"traced": n}), flush=True)
    (OUT / "exp1.json").write_text(json.dumps(results, indent=1))
