#!/usr/bin/env bash
# bench/gpu_figures.sh BUILD: the figures the open issues ask for that .gpu/check.sh does not print,
# in one device call after it (same build folder), each step's output in $OUT/figures.tgz:
#   custom_kernel     a hand-written matmul + bias + ReLU against kiln's own path (issue 23)
#   conv              every convolution product of the air step in kiln (a timeline trace) beside
#                     cuDNN (bench/conv_bench.py), bench/conv_compare.py's table (issue 21)
#   first_step        resnet18's first step, cold (empty kernel cache) and warm, with the
#                     default compile threads and with one (issue 27's 3 s / 1 s goals)
#   cifar10_memory    one epoch of examples/cifar10 on the CIFAR-10 sample: where the device
#                     memory goes (issue 22's 1.5 GiB goal; the full data set is bench/cifar10_tta.sh's)
#   recompute         the air and resnet18 steps (graph mode) with KILN_CONV_RECOMPUTE=0 and 1:
#                     ms/step, peak and arena MiB (issue 21's and 27's memory goals), one at a time
#   tma               dev/conv_engine's lab on the TMA-fed products (./lab tma: each checked, then
#                     timed beside cuBLAS and the cp.async kernels), then the air and resnet18 steps
#                     with KILN_CONV_TMA=0 and 1 (resnet18 also with KILN_CONV_RECOMPUTE=1)
#   initcheck         dev/initcheck/probe.cu under compute-sanitizer's initcheck: whether bytes
#                     written by TMA stores and by cuBLAS's products count as initialized (issue 24)
#   sanitize          compute-sanitizer's memcheck and initcheck over two graph-mode steps of cnn
#                     and air (profile_step) at batch 32 and 64, the four at once, initcheck with
#                     KILN_DEBUG=initcheck (cuBLAS's outputs zeroed before its products, whose TMA
#                     stores the tool does not count as writes); then racecheck on kiln's own
#                     kernels, one run at a time: cnn at batch 16, air at 16 without its products
#                     and with KILN_CAST_TILES=0 (on air's products, and on its tiled casts, racecheck
#                     outgrew the host's 128 GiB: Linux's OOM killer ended it, exit 9, H100
#                     2026-12-06, H200 2026-12-07), the tiled casts at test_gpu_conv_switches' shapes,
#                     and one TMA-fed test of test_gpu_ops_conv (under racecheck every such test
#                     failed with "failed to handle a hardware exception", H200 2026-12-07); each
#                     tool's summary and the kernels it names most (issue 24)
#   stem              bench/stem_gemm.py: ResNet-18's stem products on cuBLAS with K = 147 and K padded
#                     to a multiple of 8, beside cuDNN (issue 27)
#   switches          the tests that set the switches (test_gpu_bf16, test_gpu_ops_conv,
#                     test_gpu_conv_switches, test_gpu_ops_norm), the air and resnet18 steps (graph mode) at the defaults
#                     and with KILN_CONV_AHEAD=1, KILN_BN_ROWS=1 and KILN_EW_SINK=1
#                     (bench/ab_steps.sh, three rounds interleaved; all three no faster on the H200
#                     on 2026-12-05: dev/README.md), and the air step's convolutions at the
#                     defaults (bench/conv_compare.py beside cuDNN)
#   suite_switches    the whole GPU suite (ctest, fuzzers aside) with the switches that are off on:
#                     KILN_BN_ROWS=1 KILN_CONV_WGRAD_INTO=1 KILN_CONV_AHEAD=1 (each test's own
#                     setting aside, the suite's every plan takes them); on 2026-12-05 with
#                     KILN_EW_SINK=1 too, whose gradient-clipping test then failed by one ulp
#   launches          the same A/B for the switches that take launches out of the step (2026-12-05;
#                     the multi-tensor casts and the direct conv's epilogue on by default since):
#                     KILN_CONV_WGRAD_INTO=1, KILN_CAST_BATCH=0, KILN_CONV_DIRECT_EPI=0
#   dgrad_depth       Nsight Compute on air's data gradients (the col2im kernels, ten launches) with
#                     KILN_CONV_HOIST=2 and 4: time, registers, and the blocks an SM that registers
#                     and shared memory allow (depth 4 lost 135 us a step on the H100, unexplained)
#   attribution       every default workload traced in all three modes in one process
#                     (profile_step --trace: contexts made and freed one after another, where CUPTI
#                     has named replayed kernels after ones of freed contexts) and each trace's count
#                     of unattributed records and of records CUPTI misnamed (issue 26)
#   blocks            strided convolutions over few channels on the image's blocks (ResNet's stem;
#                     the default since 2026-12-06, KILN_CONV_S2D=0: on columns): test_gpu_ops_conv
#                     (its blocks cases against float64), the resnet18 step with the switch off and
#                     at the defaults (bench/ab_steps.sh, three rounds), each one's peak and arena
#                     MiB, and both steps' stem kernels in a timeline trace beside
#                     bench/stem_gemm.py's cuBLAS and cuDNN figures (issue 27)
#   remat             the resnet18 step with KILN_CONV_RECOMPUTE_INPUT=0 and _BLOCKS=0, with
#                     _BLOCKS=0 alone, and at the defaults (a block's ReLU and the stem's blocks
#                     gathered again for the weight gradients, not kept): bench/ab_steps.sh's three
#                     rounds, each one's peak and arena MiB,
#                     and the default step's 40 costliest kernels in a timeline trace (issue 27)
#   rows              KILN_IM2COL_ROWS (the stem's blocks gathered a row a thread, not a value):
#                     its tests (test_gpu_conv_switches, test_gpu_ops_conv), then the resnet18 step
#                     without and with it (bench/ab_steps.sh, three rounds; issue 27; on the H100
#                     on 2026-12-06 8.102 ms with it against 8.189: on by default since)
#   pool_blocks       KILN_POOL_GRAD_BLOCKS (max pooling's gradient at stride 2 a block of 2x2
#                     pixels a thread): its test (test_gpu_ops_pool), the resnet18 step without and
#                     with it (bench/ab_steps.sh, three rounds), and the stem pool's gradient kernel
#                     in a timeline trace of each (issue 27; H100, 2026-12-06: 8.054 ms with it
#                     against 8.142, the kernel 300 us against 395; on by default since)
#   pdl               KILN_PDL=1 (kiln's kernels launched as programmatic dependents: each waits
#                     for the one before it, then lets the next one launch): the whole GPU suite
#                     with it (fuzzers aside), then the mlp, cnn, air, air_muon and resnet18 steps
#                     without and with it (bench/ab_steps.sh, three rounds interleaved; H100,
#                     2026-12-06: 4-5.5% slower on air, air_muon and resnet18, so off)
#   few               KILN_CONV_FEW (airbench's first conv, 24 channels into 64, from a halo
#                     tile in shared memory, conv_few.cuh; ResNet-18's stem too) and
#                     KILN_CONV_FEW_WGRAD (their weight gradients from the same tiles), both on:
#                     their tests (test_gpu_ops_conv; the graph, bf16 and resume tests), the air,
#                     air_muon and resnet18 steps with neither, the first alone, both
#                     (bench/ab_steps.sh, three rounds), then dev/conv_few's lab (both kernels
#                     beside conv.cuh's forward product, batch 1024 and 2000, and ResNet's stem)
#   muon_step         the CIFAR-10 example's default step (profile_step's air_muon: batch 2000,
#                     Muon for the filters): ms/step, peak, and its 40 costliest kernels in a
#                     timeline trace, Muon's Newton-Schulz products among them (issue 22)
#   racecheck         compute-sanitizer's racecheck on kiln's own kernels (--kernel-name
#                     regex=^k_: not cuBLAS's) over two graph-mode steps of cnn (batch 16), then of
#                     air (32), one at a time, and the most host memory in use. The sanitize step's
#                     racecheck runs (four tools at once, every kernel) ended with exit 9: Linux's
#                     OOM killer had stopped profile_step at 124 GiB resident (H100,
#                     2026-12-06); mlp's graph step alone passed with 0 hazards (issue 24)
#   racecheck_probe   where compute-sanitizer's racecheck fails ("failed to handle a hardware
#                     exception" on test_gpu_conv_switches' cast-tile test and on the TMA test of
#                     test_gpu_ops_conv, with the tiled casts' shared memory static or dynamic and
#                     with KILN_CAST_TILES=0; the host's memory past 90 GiB in about 50 s on air
#                     with the tiled casts checked: H100, thirtieth session): each test with no
#                     kernel instrumented (--kernel-name regex=^zzz), under memcheck, under
#                     racecheck without its cp.async tracking, under synccheck; gpu_ops/neg as a
#                     control; air (graph mode, batch 8) with only the tiled casts checked and with
#                     none, the host's memory sampled (past 90 GiB the process holding the most,
#                     the tool's target, is killed) (issue 24)
#   racecheck_min     dev/racecheck/probe.cu: each of the patterns the tool failed on, alone in the
#                     smallest kernel that has it (the tiled casts at air's grid and at 8 x 9
#                     blocks, mbarrier stages filled by plain stores, by TMA with the map a
#                     parameter or in global memory, a bare wgmma, the library's TMA-fed forward
#                     product with either kind of map, conv.cuh's cp.async one), each checked
#                     natively, then each under racecheck alone (the TMA ones also without its
#                     asynchronous-copy tracking), memcheck over all; the host's memory sampled,
#                     as racecheck_probe's (issue 24)
#   persist           dev/conv_engine's lab (./lab tma) on air's 15x15x64->64, 15x15x64->256 and
#                     7x7x256->256 forward products: the one-tile-a-block kernels beside the
#                     persistent ones (a block an SM over the tiles, the producer copying the next
#                     tile's stages during a tile's stores), which store from the registers or
#                     through a room of shared memory of their own as the library's kernels do,
#                     and on 15x15x64->64 one with all of its filters resident in shared memory,
#                     streaming only the image (resident.cuh; both new in the thirty-first
#                     session, not yet run) (issue 21: the short reductions of air's 15x15
#                     layers, 9 stages a tile, pay a tile's first copies and its stores unhidden)
#   windows           Nsight Compute on ResNet-18's window kernels (its stem pool and the pool's
#                     gradient, the strided data gradients' col2im) in a replayed step: time, DRAM
#                     throughput and bytes, achieved occupancy and what limits it, registers, L1 and
#                     L2 hit rates, the warps' stalls on memory (twenty-fifth session: at 1.4-1.9
#                     TB/s after their loads were put in flight together, the col2im at 3.0; why?)
#   dgrad_ws          KILN_CONV_DGRAD_WS=1 and =2 (stride-1 TMA data gradients with warps of their
#                     own for the epilogue, its staged tiles in one room and five stages, or in two
#                     and four as in the twenty-sixth session): the tests (test_gpu_conv_switches,
#                     bitwise against the switch off; test_cpu_conv_tma), the air and resnet18 steps
#                     without and with each (bench/ab_steps.sh, three rounds; with @/tmp/old/b too
#                     where that build of an older revision exists: the descriptors' change, the
#                     twenty-ninth session's, against 5e58ebe), and air's data gradients in a
#                     timeline trace of each (H100, twenty-seventh session, two rooms: bitwise, but
#                     air 1.019x and resnet18 1.034x; the 7x7x256 one 133.0 us against 135.2)
#   dgrad_ncu         Nsight Compute on air's 7x7x256->256 data gradient (issue 21: 133-135 us, its
#                     forward product of the same GEMM shape 84), the two-block kernel and
#                     KILN_CONV_DGRAD_WS=1's: speed of light, warp states, scheduler, occupancy,
#                     and each kernel's stall samples by SASS line (ncu_src_ws*.txt.gz): do the
#                     epilogue's warps or the products set the pace? The kernels' names from a
#                     compile-only dump of each (their hashes follow the source)
# Every step has a time limit; a summary line per step is printed last. Naming steps after BUILD
# runs those alone (bench/gpu_figures.sh build-gpu tma recompute).
set -u
build=${1:?usage: bench/gpu_figures.sh BUILD [STEP...]}
shift
only=" $* "
out=${OUT:-/tmp/out}/figures
mkdir -p "$out"
summary=()
step() {
  local name=$1 lim=$2 t0=$SECONDS
  shift 2
  [ "$only" = "  " ] || [[ "$only" == *" $name "* ]] || return 0
  timeout "$lim" bash -c "$*" >"$out/$name.txt" 2>&1
  local rc=$?
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" \
    "$(tail -n 1 "$out/$name.txt" | cut -c1-110)")")
}
# The code a step starts with to sample the host's memory every 2 s into $out/FILE, in the
# background (mon: its pid); past 90 GiB it kills the process holding the most, a sanitizer's
# target, and says which (a pattern for pkill would match the step's own command line too).
watch_host() {
  echo "(while sleep 2; do u=\$(free -m | awk '/Mem/{print \$3}'); echo \"\$SECONDS \$u\"
    [ \$u -gt 92000 ] && big=\$(ps -eo pid=,rss= --sort=-rss | awk 'NR == 1 {print \$1}') &&
      echo \"killed \$(ps -o args= -p \$big | cut -c1-100)\" && kill -9 \$big; done > $out/$1) & mon=\$!"
}
step custom_kernel 120 "$build/custom_kernel"
step conv 300 "python3 bench/conv_bench.py --json > $out/cudnn.jsonl && mkdir -p $out/trace &&
  $build/profile_step --workload air --mode graph --trace $out/trace > /dev/null &&
  python3 tools/trace_summary.py --top 40 $out/trace/air_graph.json > $out/air_kernels.txt &&
  python3 bench/conv_compare.py $out/trace/air_graph.json $out/cudnn.jsonl"
step first_step 400 "$build/profile_step --workload mlp --compile-only > /dev/null  # the files NVRTC reads, cached
  for threads in 1 ''; do
    rm -rf /tmp/kiln-cold-cache
    for cache in cold warm; do
      printf '%s cache, compile threads %s: ' \$cache \${threads:-default}
      KILN_CACHE_DIR=/tmp/kiln-cold-cache KILN_COMPILE_THREADS=\$threads \
        $build/profile_step --workload resnet18 --mode graph --steps 2 --blocks 2 --json |
        grep -o '\"first_step_ms\": *[0-9.]*'
    done
  done"
step cifar10_memory 300 "$build/cifar10 \${KILN_CIFAR10_SAMPLE:?} --epochs 1 --batch 500 --no-cache | tail -n 3"
step recompute 500 "for w in air resnet18; do for r in 0 1; do
    printf '%s KILN_CONV_RECOMPUTE=%s: ' \$w \$r
    KILN_CONV_RECOMPUTE=\$r $build/profile_step --workload \$w --mode graph --json |
      grep -o '\"ms_per_step\": *[0-9.]*\|\"peak_mib\": *[0-9.]*\|\"arena_mib\": *[0-9.]*' | tr '\n' ' '
    echo
  done; done"
step tma 900 "nvcc -O3 -std=c++17 -DLAB_TMA_ONLY -gencode arch=compute_90a,code=sm_90a \
    -o /tmp/lab_tma dev/conv_engine/lab.cu -lcublas && timeout 300 /tmp/lab_tma tma
  for w in air resnet18; do for t in 0 1; do
    printf '%s KILN_CONV_TMA=%s: ' \$w \$t
    KILN_CONV_TMA=\$t timeout 120 $build/profile_step --workload \$w --mode graph --json |
      grep -o '\"ms_per_step\": *[0-9.]*\|\"peak_mib\": *[0-9.]*\|\"arena_mib\": *[0-9.]*' | tr '\n' ' '
    echo
  done; done
  printf 'resnet18 KILN_CONV_TMA=1 KILN_CONV_RECOMPUTE=1: '
  KILN_CONV_TMA=1 KILN_CONV_RECOMPUTE=1 timeout 120 $build/profile_step --workload resnet18 --mode graph --json |
    grep -o '\"ms_per_step\": *[0-9.]*\|\"peak_mib\": *[0-9.]*\|\"arena_mib\": *[0-9.]*' | tr '\n' ' '
  echo"
step initcheck 240 "nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/probe_init \
    dev/initcheck/probe.cu -lcublas && /tmp/probe_init &&
  compute-sanitizer --tool initcheck /tmp/probe_init 2>&1 |
    grep -E '^[0-9]\\.|Uninitialized|ERROR SUMMARY' | uniq -c  # in order: the reports before each sum"
step sanitize 560 "for w in cnn air; do for t in memcheck initcheck; do
    b=32; [ \$w = air ] && b=64
    d=; [ \$t = initcheck ] && d=initcheck # cuBLAS's outputs zeroed first: TMA stores unseen
    ( KILN_DEBUG=\$d timeout 300 compute-sanitizer --tool \$t --print-limit 30 \
        $build/profile_step --workload \$w --mode graph --steps 2 --blocks 1 --batch \$b \
        > $out/\${t}_\$w.txt 2>&1; echo \"exit \$?\" >> $out/\${t}_\$w.txt ) &
  done; done; wait
  # racecheck one run at a time (four at once, Linux's OOM killer stopped profile_step at 124 GiB),
  # kiln's kernels only, air's products apart: on air's steps racecheck outgrew the host's 128 GiB;
  # air with KILN_CAST_TILES=0 (H200, 2026-12-07: the tiled casts alone took the tool past 128 GiB
  # within 15 s, every other family of air's kernels 0 hazards), the tiled casts at the tests' shapes
  for r in 'cnn 16 - -' 'air 16 conv|matmul KILN_CAST_TILES=0'; do set -- \$r
    x=; [ \$3 = - ] || x=\"--kernel-name-exclude regex=\$3\"
    e=; [ \$4 = - ] || e=\$4
    env \$e timeout 180 compute-sanitizer --tool racecheck --kernel-name regex=^k_ \$x --print-limit 30 \
      $build/profile_step --workload \$1 --mode graph --steps 2 --blocks 1 --batch \$2 \
      > $out/racecheck_\$1.txt 2>&1; echo \"exit \$?\" >> $out/racecheck_\$1.txt
  done
  timeout 60 compute-sanitizer --tool racecheck --kernel-name regex=^k_cast_x --print-limit 30 \
    $build/tests/test_gpu_conv_switches --filter 'gpu_ops/conv2d_filter_casts*' \
    > $out/racecheck_cast_tiles.txt 2>&1; echo \"exit \$?\" >> $out/racecheck_cast_tiles.txt
  # the products' kernels at the convolution tests' small shapes, one test (every TMA-fed and
  # wgmma test failed under the tool with 'failed to handle a hardware exception', H200 2026-12-07)
  timeout 120 compute-sanitizer --tool racecheck --kernel-name regex=^k_ --print-limit 30 \
    $build/tests/test_gpu_ops_conv --filter 'gpu_ops/conv2d_products_fed_by_the_tensor_memory_accelerator' \
    > $out/racecheck_conv_tests.txt 2>&1
  echo \"exit \$?\" >> $out/racecheck_conv_tests.txt
  for f in $out/memcheck_*.txt $out/initcheck_*.txt $out/racecheck_*.txt; do
    echo \"\$(basename \$f): \$(tail -n 1 \$f); \$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \$f | tail -n 1)\"
    grep -E '^=+ +at ' \$f | sort | uniq -c | sort -rn | head -n 3
  done"
step stem 120 "python3 bench/stem_gemm.py"
step dgrad_depth 300 "for h in 2 4; do echo KILN_CONV_HOIST=\$h
    KILN_CONV_HOIST=\$h ncu --graph-profiling node --kernel-name regex:k_matmul_col2im --launch-count 10 \
      --csv --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,sm__warps_active.avg.pct_of_peak_sustained_active \
      $build/profile_step --workload air --mode graph --steps 1 --blocks 1 2>/dev/null | grep -E '^\"[0-9]' |
      awk -F'\",\"' '{sub(/\"$/, \"\", \$NF); print \$5, \$(NF-2), \$NF}' | cut -c1-150
  done"
step attribution 200 "rm -rf /tmp/kiln-attribution && $build/profile_step --trace /tmp/kiln-attribution > /dev/null &&
  for f in /tmp/kiln-attribution/*.json; do
    python3 tools/trace_summary.py \$f 2>/dev/null | head -n 1
    printf '  misnamed by CUPTI, kept in place: '
    grep -o 'CUPTI names this kernel' \$f | wc -l
  done"
step switches 500 "ctest --test-dir $build -R 'test_gpu_bf16|test_gpu_ops_conv|test_gpu_conv_switches|test_gpu_ops_norm' --output-on-failure | tail -n 3
  bash bench/ab_steps.sh $build 3 air resnet18 -- '' KILN_CONV_AHEAD=1 KILN_BN_ROWS=1 KILN_EW_SINK=1
  python3 bench/conv_bench.py --json > $out/cudnn_sw.jsonl && mkdir -p $out/trace_sw &&
  $build/profile_step --workload air --mode graph --trace $out/trace_sw > /dev/null &&
  python3 bench/conv_compare.py $out/trace_sw/air_graph.json $out/cudnn_sw.jsonl"
step suite_switches 420 "KILN_BN_ROWS=1 KILN_CONV_WGRAD_INTO=1 KILN_CONV_AHEAD=1 \
  ctest --test-dir $build -E '^fuzz_' --output-on-failure | grep -E 'Assertion|FAIL|tests passed|Failed' | tail -n 25"
step launches 450 "bash bench/ab_steps.sh $build 3 air resnet18 -- '' KILN_CONV_WGRAD_INTO=1 \
  KILN_CAST_BATCH=0 KILN_CONV_DIRECT_EPI=0"
step blocks 560 "ctest --test-dir $build -R 'test_gpu_ops_conv|test_gpu_conv_switches' --output-on-failure | tail -n 3
  bash bench/ab_steps.sh $build 3 resnet18 -- KILN_CONV_S2D=0 ''
  for s in 0 1; do printf 'resnet18 KILN_CONV_S2D=%s: ' \$s
    KILN_CONV_S2D=\$s timeout 120 $build/profile_step --workload resnet18 --mode graph --json |
      grep -o '\"ms_per_step\": *[0-9.]*\|\"peak_mib\": *[0-9.]*\|\"arena_mib\": *[0-9.]*' | tr '\n' ' '
    echo
    mkdir -p $out/trace_s2d\$s && KILN_CONV_S2D=\$s timeout 120 $build/profile_step --workload resnet18 \
      --mode graph --trace $out/trace_s2d\$s > /dev/null &&
      python3 tools/trace_summary.py --top 25 $out/trace_s2d\$s/resnet18_graph.json | head -n 40
    rm -rf $out/trace_s2d\$s
  done
  timeout 100 python3 bench/stem_gemm.py"
step remat 400 "off='KILN_CONV_RECOMPUTE_INPUT=0 KILN_CONV_RECOMPUTE_BLOCKS=0'
  bash bench/ab_steps.sh $build 3 resnet18 -- \"\$off\" KILN_CONV_RECOMPUTE_BLOCKS=0 ''
  for s in \"\$off\" KILN_CONV_RECOMPUTE_BLOCKS=0 ''; do printf 'resnet18 %s: ' \"\$s\"
    env \$s timeout 120 $build/profile_step --workload resnet18 --mode graph --json |
      grep -o '\"ms_per_step\": *[0-9.]*\|\"peak_mib\": *[0-9.]*\|\"arena_mib\": *[0-9.]*' | tr '\n' ' '
    echo
  done
  mkdir -p $out/trace_remat && timeout 120 $build/profile_step --workload resnet18 --mode graph \
    --trace $out/trace_remat > /dev/null &&
    python3 tools/trace_summary.py --top 40 $out/trace_remat/resnet18_graph.json | head -n 60
  rm -rf $out/trace_remat"
step rows 300 "ctest --test-dir $build -R 'test_gpu_conv_switches|test_gpu_ops_conv' --output-on-failure | tail -n 3
  bash bench/ab_steps.sh $build 3 resnet18 -- KILN_IM2COL_ROWS=0 ''"
step pool_blocks 300 "ctest --test-dir $build -R test_gpu_ops_pool --output-on-failure | tail -n 3
  bash bench/ab_steps.sh $build 3 resnet18 -- KILN_POOL_GRAD_BLOCKS=0 ''
  for s in 0 1; do mkdir -p $out/trace_pb\$s && KILN_POOL_GRAD_BLOCKS=\$s timeout 120 $build/profile_step \
      --workload resnet18 --mode graph --trace $out/trace_pb\$s > /dev/null &&
      python3 tools/trace_summary.py --top 40 $out/trace_pb\$s/resnet18_graph.json | grep -i 'pool\|kernel'
    rm -rf $out/trace_pb\$s
  done"
step pdl 560 "KILN_PDL=1 ctest --test-dir $build -E '^fuzz_' --output-on-failure |
    grep -E 'Assertion|FAIL|tests passed|Failed' | tail -n 25
  bash bench/ab_steps.sh $build 3 mlp cnn air air_muon resnet18 -- '' KILN_PDL=1"
step few 400 "ctest --test-dir $build -R test_gpu_ops_conv --output-on-failure | tail -n 3
  ctest --test-dir $build -R 'test_gpu_graph|test_gpu_bf16|examples_resume' \
    --output-on-failure | tail -n 3
  bash bench/ab_steps.sh $build 3 air air_muon resnet18 -- KILN_CONV_FEW=0 KILN_CONV_FEW_WGRAD=0 ''
  nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/lab_few dev/conv_few/lab.cu &&
    /tmp/lab_few && /tmp/lab_few wgrad"
step muon_step 200 "$build/profile_step --workload air_muon --mode graph
  mkdir -p $out/trace_muon && timeout 120 $build/profile_step --workload air_muon --mode graph \
    --trace $out/trace_muon > /dev/null &&
    python3 tools/trace_summary.py --top 40 $out/trace_muon/air_muon_graph.json | head -n 60
  rm -rf $out/trace_muon"
step racecheck 300 "(while sleep 5; do free -m | awk '/Mem/{print \$3}'; done > $out/host_mib.txt) & mon=\$!
  for r in 'cnn 16' 'air 32'; do set -- \$r; f=$out/racecheck_\$1.txt; t0=\$SECONDS
    timeout 140 compute-sanitizer --tool racecheck --kernel-name regex=^k_ --print-limit 20 \
      $build/profile_step --workload \$1 --mode graph --steps 2 --blocks 1 --batch \$2 > \$f 2>&1
    echo \"== \$1 (batch \$2, kiln's kernels): exit \$? after \$((SECONDS - t0)) s\"
    grep -E 'RACECHECK SUMMARY|Error|^=+ +(Error|Warning)' \$f | sort | uniq -c | head -n 8
  done
  kill \$mon; echo \"most host memory in use: \$(sort -n $out/host_mib.txt | tail -n 1) MiB\""
step racecheck_probe 400 "$(watch_host probe_host_mib.txt)
  b=\$(cd $build && pwd); t=\$b/tests; c='--filter gpu_ops/conv2d_filter_casts*'
  p='--filter gpu_ops/conv2d_products_fed_by_the_tensor_memory_accelerator'
  R='compute-sanitizer --tool racecheck --print-limit 10'
  a=\"\$b/profile_step --workload air --mode graph --steps 2 --blocks 1 --batch 8\"
  while read -r name cmd; do
    timeout 60 \$cmd < /dev/null > $out/probe_\$name.txt 2>&1; r=\$?
    echo \"\$name: exit \$r; \$(grep -E 'SUMMARY|Internal Sanitizer|Synthesis' $out/probe_\$name.txt |
      sort | uniq -c | tr '\\n' ' ' | cut -c1-220)\"
  done <<END
casts_none \$R --kernel-name regex=^zzz \$t/test_gpu_conv_switches \$c
tma_none \$R --kernel-name regex=^zzz \$t/test_gpu_ops_conv \$p
casts_memcheck compute-sanitizer --tool memcheck --print-limit 10 \$t/test_gpu_conv_switches \$c
tma_memcheck compute-sanitizer --tool memcheck --print-limit 10 \$t/test_gpu_ops_conv \$p
casts_no_async \$R --racecheck-memcpy-async no --kernel-name regex=^k_cast_x \$t/test_gpu_conv_switches \$c
casts_synccheck compute-sanitizer --tool synccheck --print-limit 10 \$t/test_gpu_conv_switches \$c
neg \$R \$t/test_gpu_ops_unary --filter gpu_ops/neg*
air_none \$R --kernel-name regex=^zzz \$a
air_cast_tiles \$R --kernel-name regex=_tiles_ \$a
END
  kill \$mon; echo \"most host memory in use: \$(sort -k2 -n $out/probe_host_mib.txt | tail -n 1)\""
step racecheck_min 420 "$(watch_host min_host_mib.txt)
  nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/probe_race dev/racecheck/probe.cu &&
    /tmp/probe_race || echo 'the probe failed natively: what follows says nothing of the tool'
  R='compute-sanitizer --tool racecheck --print-limit 10'
  while read -r name flags; do
    timeout 90 \$R \$flags /tmp/probe_race \${name%_noasync} > $out/min_\$name.txt 2>&1; r=\$?
    echo \"\$name: exit \$r; \$(grep -E 'SUMMARY|Internal Sanitizer|WRONG| ok ' $out/min_\$name.txt |
      sort | uniq -c | tr '\\n' ' ' | cut -c1-200)\"
  done <<END
control
casts_small
casts
mbar
tma
tma_global
wgmma
fprop
fprop_global
fprop_cpasync
tma_noasync --racecheck-memcpy-async no
fprop_noasync --racecheck-memcpy-async no
END
  timeout 90 compute-sanitizer --tool memcheck /tmp/probe_race > $out/min_memcheck.txt 2>&1
  echo \"memcheck, every case: exit \$?; \$(grep -E 'ERROR SUMMARY' $out/min_memcheck.txt)\"
  kill \$mon; echo \"most host memory in use: \$(sort -k2 -n $out/min_host_mib.txt | tail -n 1)\""
step persist 420 "nvcc -O3 -std=c++17 -DLAB_TMA_ONLY -gencode arch=compute_90a,code=sm_90a \
    -o /tmp/lab_tma dev/conv_engine/lab.cu -lcublas &&
  for s in '15x15x64->64' '15x15x64->256' '7x7x256->256'; do
    timeout 120 /tmp/lab_tma tma \$s | grep -E '^\| [0-9x>-]+ \| fwd \| (tma|wgmma)' || echo \"\$s: exit \$?\"
  done"
step windows 300 "ncu --graph-profiling node --kernel-name regex:'k_max_pool|k_col2im_add' \
    --launch-count 8 --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats --csv --page details \
    $build/profile_step --workload resnet18 --mode graph --steps 1 --blocks 1 2>/dev/null |
    grep -E 'Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Block Limit|Registers Per|L1/TEX Hit|L2 Hit|Long Scoreboard|Stall' |
    awk -F'\",\"' '{sub(/\"$/, \"\", \$NF); print substr(\$5, 1, 60), \$(NF-2), \$(NF-1), \$NF}'"
step dgrad_ws 540 "ctest --test-dir $build -R 'test_gpu_conv_switches|test_cpu_conv_tma' --output-on-failure | tail -n 3
  old=; [ -x /tmp/old/b/profile_step ] && old=@/tmp/old/b
  bash bench/ab_steps.sh $build 3 air resnet18 -- '' KILN_CONV_DGRAD_WS=1 KILN_CONV_DGRAD_WS=2 \$old
  for ws in 0 1 2; do mkdir -p $out/trace_ws\$ws
    KILN_CONV_DGRAD_WS=\$ws $build/profile_step --workload air --mode graph --trace $out/trace_ws\$ws > /dev/null &&
      python3 tools/trace_summary.py --top 40 $out/trace_ws\$ws/air_graph.json | grep -E 'median span|k_matmul_col2im'
  done"
step dgrad_ncu 420 "for ws in 0 1; do
    rm -rf /tmp/dump_ws\$ws && KILN_CONV_DGRAD_WS=\$ws KILN_DUMP_KERNELS=/tmp/dump_ws\$ws \
      $build/profile_step --workload air --compile-only > /dev/null || exit 1
    k=\$(grep -l 'H = 7, W = 7, OH = 7, OW = 7, CO = 256, CI = 256' /tmp/dump_ws\$ws/*gelu_grad_3x3_s1*.cu |
      head -n 1 | xargs -r basename | sed 's/[.]cu\$//')
    echo \"KILN_CONV_DGRAD_WS=\$ws: \${k:?no 7x7x256 data gradient in the dump}\"
    KILN_CONV_DGRAD_WS=\$ws timeout 150 ncu --graph-profiling node -k \$k -c 1 --section SpeedOfLight \
      --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      $build/profile_step --workload air --mode graph --steps 1 --blocks 1 > $out/ncu_ws\$ws.txt 2>&1
    KILN_CONV_DGRAD_WS=\$ws timeout 150 ncu --graph-profiling node -k \$k -c 1 --section SourceCounters \
      --section WarpStateStats --page source --print-source sass \
      $build/profile_step --workload air --mode graph --steps 1 --blocks 1 2>&1 | gzip > $out/ncu_src_ws\$ws.txt.gz
    grep -E 'Duration|Issued Ipc Active|No Eligible|Warp Cycles Per Issued' $out/ncu_ws\$ws.txt
  done"
# a device call returns at most 8 files: everything in one archive, as .gpu/check.sh does
tar -czf "${OUT:-/tmp/out}/figures.tgz" -C "$out" . && rm -rf "$out"
printf '%s\n' "${summary[@]}"
