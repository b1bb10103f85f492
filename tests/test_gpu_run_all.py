"""`benchmarks/gpu/run_all.py --dry-run`: the prepared GPU run, end to end on
a CPU, on the tiny presets.

The rows are processes of their own, each on its row's backend whatever the
suite's; the three suites (the CI runs the whole suite once per backend)
share them out, so that a CI run runs each row once: one example's rows on
JAX and torch in each suite, so each suite prepares at most one example's
data (with TensorFlow) and measures with both backends' kernel probes. The
GPU run has no TensorFlow rows (the device machine has no TensorFlow); the
TensorFlow suite takes nanoGPT's loop and the GPT rows, which need no
prepared data.
"""

import os
import subprocess
import sys

import keras
import pytest

from harness import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu" / "run_all.py"
ROWS = {
    "tensorflow": ("nanogpt", "gpt-jax", "gpt-torch"),
    "jax": ("translation-jax", "translation-torch"),
    "torch": ("bert-jax", "bert-torch"),
}


@pytest.mark.long_run
def test_dry_run_prints_the_table(tmp_path):
    rows = ROWS[keras.backend.backend()]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--data-dir", str(tmp_path),
         "--rows", ",".join(rows)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    header = lines.index("| row | steps | wall s | ms/step | tokens/s | MFU | attention kernel "
                         "| loss | val_loss |")
    table = [line.split(" | ") for line in lines[header + 2:] if line.startswith("| ")]
    assert [cells[0].lstrip("| ") for cells in table] == list(rows)
    for cells in table:
        assert float(cells[3]) > 0 and float(cells[-1].rstrip(" |")) > 0
        assert cells[6]  # the attention kernel
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--rows", "nothing",
                        "--data-dir", str(tmp_path)], cwd=ROOT, check=True,
                       capture_output=True)
