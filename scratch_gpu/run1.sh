set -x
python3 -m pip install --no-deps --no-index -q .gpu_wheels/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
export XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*stateless.* --xla_dump_hlo_as_text"
OUT=$OUT TRACE=1 VARIANTS=${VARIANTS:-default,cb_while,cb_while_min1} ROWS=${ROWS:-greedy:1,beam:1,greedy:32} REPEATS=7 timeout ${T:-400} python3 scratch_gpu/exp1.py 2>$OUT/stderr.txt
echo rc $?
cd /tmp/dump && ls | head -50 && tar czf $OUT/dump.tgz $(ls | grep after_optimizations.txt) && ls -la $OUT
tail -5 $OUT/stderr.txt
