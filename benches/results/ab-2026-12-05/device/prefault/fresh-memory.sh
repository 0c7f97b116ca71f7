set -u; REPO=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/wheels/mori-*.whl
uname -r
for size in 1048576 4194304; do
 for th in 1 4; do for pf in 1 0; do
  echo "== size $size threads $th prefault $pf"
  (cd /tmp && PYTHONPATH=/tmp/site MORI_CHECKSUM_THREADS=$th MORI_UMBP_PREFAULT=$pf taskset -c 0-7 timeout 40 python3 $REPO/tmpexp/emb.py $size)
 done; done
done 2>&1 | tee $OUT/emb.log
