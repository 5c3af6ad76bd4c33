export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p $OUT/d
python3 benchmarks/probe_predict_cli.py make /tmp/in100k.extxyz --structures 100000 > $OUT/d/make.log
python3 -m mlff_distiller.cli predict --input /tmp/in100k.extxyz --output /tmp/warm.extxyz > /dev/null 2>&1
bash scripts/ab_package.sh run 2 /tmp/ab -- python3 benchmarks/probe_predict_cli.py time /tmp/in100k.extxyz --label 100k 2>&1 | tail -4 | tee $OUT/d/ab.log
python3 -m mlff_distiller.cli predict --input /tmp/in100k.extxyz --output /tmp/o3.extxyz 2>/dev/null > $OUT/d/cli_parts_new.json
PYTHONPATH=.ab/old:/tmp/site python3 -m mlff_distiller.cli predict --input /tmp/in100k.extxyz --output /tmp/o4.extxyz 2>/dev/null > $OUT/d/cli_parts_old.json
grep -A6 parts $OUT/d/cli_parts_new.json $OUT/d/cli_parts_old.json
timeout 120 python3 benchmarks/probe_md_cli.py --out $OUT/d --steps 5000 2>&1 | tail -9
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_capture_policy.py tests/test_batching_chunks.py tests/test_predict_cache.py tests/test_predict_stream.py tests/test_engine.py -k "cuda or gpu or chunk or capture" 2>&1 | tail -3 | tee $OUT/d/pytest.log
