"""Test configuration: one backend per run, chosen by `KERAS_BACKEND`."""

import getpass
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# JAX compiles the same programs in every process an example's test starts
# (a run, its resumption, the runs killed mid-write, on every worker): a
# persistent compilation cache that the test processes and the scripts they
# start share compiles each program once (the tiny BERT run's test: 185 s
# without, 138 s with). Keyed by the program, so an entry is never read for
# another one.
try:
    _user = getpass.getuser()
except Exception:  # no name for this user id (some containers)
    _user = "anyone"
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"keras_attention_tests_jax_cache_{_user}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# The tests' programs are tiny: XLA's time goes to compiling them, not running
# them, and most of a compilation on a CPU is LLVM's optimization of the
# generated code. Without it (level 0) the programs run the same operations
# (the graph passes, fusion included, still run; no fast-math either way),
# rounded alike up to the last bit (where LLVM would fuse a multiply and an
# add), and the JAX suite runs a good part faster (TensorFlow's less: it
# compiles with XLA only in `generate` and where a test asks). Set for JAX
# and TensorFlow, unless XLA_FLAGS names a level already; the scripts the
# tests start inherit it. Benchmarks and users keep XLA's default.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

# Each worker of a run (and each script it starts) gets its share of the
# cores for torch's threads. Left to itself, torch takes one OpenMP thread
# per core in every process, and with two workers on two cores the threads
# spin waiting on one another: the README's quick start fit took 25 s
# instead of 2 that way. (TensorFlow and JAX showed no such loss.) Set before
# torch loads; the scripts inherit the environment.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

import keras  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """The `long_run` tests first, in their order: collected last (they are
    in `tests/`'s own files), they ran last, and with two workers one of
    them alone could end the run minutes after the other worker was done."""
    items.sort(key=lambda item: item.get_closest_marker("long_run") is None)


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend: {keras.backend.backend()}"


@pytest.fixture(autouse=True)
def _reset_dtype_policy():
    """Each test starts and ends with the float32 policy."""
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
