# GPU experiment 2 (bf16, the gpu preset's size): one-row product variants, ~6 min.
python3 -m pip install --no-deps --no-index -q .gpu_wheels/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD
export XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*stateless.* --xla_dump_hlo_as_text"
OUT=$OUT VARIANTS=${VARIANTS:-current,embed,percall,transposed,rows2,nocb} ROWS=${ROWS:-greedy:1,beam:1,greedy:32} REPEATS=7 timeout ${T:-420} python3 scratch_gpu/exp2.py 2>$OUT/stderr.txt
echo rc $?
cd /tmp/dump && tar czf $OUT/dump.tgz $(ls | grep -E "after_optimizations.txt|thunk_sequence_after") ; ls -la $OUT
