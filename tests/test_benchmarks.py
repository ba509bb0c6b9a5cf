"""Every benchmark script runs on this machine and prints its figures and ratios.

Smoke runs with small settings: they check that the scripts work and report what they promise (the
baseline measured in the same run, the ratio, the target), never how fast anything is.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_session import stages

REPO = Path(__file__).resolve().parents[1]
NUMBER = r"[-+]?\d+(?:\.\d+)?"


def run_benchmark(script: str, *arguments: str, timeout: float = 300) -> str:
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *arguments], cwd=REPO,
                            env=environment, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_kernel_benchmark_runs_the_reference_path_on_cpu_against_its_baselines() -> None:
    out = run_benchmark("kernels.py", "--iters", "2")
    assert "device: CPU (torch reference path)" in out
    assert len(re.findall(rf"paged_attention\s+{NUMBER} us\s+{NUMBER} GB/s", out)) >= 2
    assert re.search(rf"paged / sdpa speed\s+{NUMBER}x", out)
    assert re.search(rf"zero_blocks vs memset: {NUMBER}%\s+\[target >= 80%: (met|NOT met)\]", out)


def test_the_ohttp_benchmark_prints_costs_next_to_bare_aes_gcm() -> None:
    out = run_benchmark("ohttp.py")
    assert re.search(rf"small \(64 B\): encapsulate\+decapsulate\s+{NUMBER} µs", out)
    assert re.search(rf"64 KiB: encapsulate\+decapsulate\s+{NUMBER} µs", out)
    assert len(re.findall(rf"bare AES-GCM\s+{NUMBER} MB/s", out)) == 2
    assert "64 B chunks as a token stream" in out


def test_the_issuer_signing_benchmark_prints_its_rate_beside_the_pure_python_path() -> None:
    out = run_benchmark("issuer_signing.py", "--seconds", "0.2")
    assert re.search(rf"pure-Python path \(before\)\s+{NUMBER} tokens/s", out)
    assert re.search(rf"issuer path \((openssl|gmp)\s*\)\s+{NUMBER} tokens/s", out)
    assert re.search(rf"issuer path, GMP fallback\s+{NUMBER} tokens/s", out)
    assert re.search(rf"speed-up over the pure-Python path: {NUMBER}x", out)
    assert re.search(rf"\[target >= 2000/s per core: (met|NOT met)\]", out)


def test_the_gpu_engine_benchmark_documents_its_options_and_refuses_to_run_without_cuda() -> None:
    out = run_benchmark("engine_gpu.py", "--help")
    for option in ("--preset", "--batches", "--decode-steps", "--decode-prompt-len", "--requests", "--hf-batch-size",
                   "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization", "--skip-transformers",
                   "--seed", "--decode-only", "--profile-batch", "--bridge-toll-us"):
        assert option in out, option
    assert "Llama-3.2-1B" in out and "Llama-3.1-8B" in out
    # No device visible, whatever this machine has: the script must say so and stop before writing a model.
    environment = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "engine_gpu.py"), "--preset", "8b"], cwd=REPO,
                            env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "CUDA GPU and none is available here" in result.stderr


@pytest.mark.slow
def test_the_engine_benchmark_compares_with_transformers_and_prices_zeroing() -> None:
    out = run_benchmark("engine_throughput.py", "--quick", "--requests", "6", "--repeats", "1", "--bridge-toll-us", "300")
    for line in ("transformers.generate (static batches of 16):", "veil, zero-on-free:", "veil, zeroing skipped:"):
        assert re.search(re.escape(line) + rf"\s+{NUMBER} output tokens/s", out), line
    assert re.search(rf"ratio veil / transformers: {NUMBER}x\s+\(target >= 3x; best of each", out)
    assert re.search(rf"cost of zero-on-free: {NUMBER}% of throughput", out)
    zeroing = re.search(rf"time inside zeroing: ({NUMBER}) ms of the zero-on-free run, ({NUMBER})% of it", out)
    assert zeroing and float(zeroing.group(1)) > 0  # the quick workload frees blocks, so zeroing ran and was timed
    assert re.search(rf"ratio tolled / toll-free: {NUMBER}\s+\(target >= 0.90", out)
    # Every crossing of the tolled run paid the toll on the step loop's thread (nothing overlaps it on a CPU).
    waited = re.search(rf"time waiting at the toll: ({NUMBER}) ms of the tolled run, ({NUMBER})% of it: "
                       rf"tolled / toll-free ({NUMBER}) within one run", out)
    crossings = re.search(r"bridge crossings: (\d+) host-to-device and (\d+) device-to-host", out)
    assert waited and crossings
    assert float(waited.group(1)) >= 0.3 * (int(crossings.group(1)) + int(crossings.group(2)))
    assert abs(float(waited.group(3)) - (1 - float(waited.group(2)) / 100)) < 0.002


@pytest.mark.slow
def test_the_end_to_end_benchmark_compares_the_encrypted_path_with_both_baselines() -> None:
    out = run_benchmark("e2e.py", "--requests", "3", "--max-tokens", "3", "--concurrency", "1", "2")
    rows = [line for line in out.splitlines() if re.match(r"\s+[12] \|", line)]
    assert len(rows) == 2
    for row in rows:
        figures = re.findall(NUMBER, row.split("|", 1)[1])
        assert len(figures) == 11  # 3 paths' figures, 2 throughput ratios, 2 added TTFTs
        assert all(float(value) > 0 for value in figures[:7])
    assert "targets: throughput ratio >= 0.90, added median TTFT <= 15 ms" in out


def test_the_host_time_benchmark_splits_each_step_into_forward_and_host() -> None:
    out = run_benchmark("engine_host.py", "--batches", "2", "8", "--steps", "3", "--repeats", "1",
                        "--compare-attention")
    rows = re.findall(rf"^\s+(\d+)\s+(greedy|sampled)\s+float32 \|\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+(\d+)%"
                      rf"\s+({NUMBER})\s+({NUMBER}) \|\s+({NUMBER}) \|\s+({NUMBER})\s+({NUMBER})\s+(\d+)\s+(\d+)$",
                      out, re.M)
    assert [(batch, mode) for batch, mode, *_ in rows] == [("2", "greedy"), ("2", "sampled"), ("8", "greedy"),
                                                          ("8", "sampled")]
    for _, _, step, forward, host, _, head, host_less_head, text, uploads, downloads, up_bytes, down_bytes in rows:
        assert float(forward) > 0 and abs(float(step) - float(forward) - float(host)) < 0.02
        # The LM head ran inside the step and is split out of its host time; the text stage ran beside it.
        assert float(head) > 0 and abs(float(host) - float(head) - float(host_less_head)) < 0.02
        assert float(text) > 0
        # A decode step crosses the bridge once each way, and each crossing carries something.
        assert float(uploads) == float(downloads) == 1.0 and int(up_bytes) > 0 and int(down_bytes) > 0
    # The batched CPU attention against the per-sequence kernel, and each step against the weights floor.
    speedups = re.findall(rf"batch\s+(\d+): step {NUMBER} -> {NUMBER} ms \(({NUMBER})x\)", out)
    assert [batch for batch, _ in speedups] == ["2", "8"] and all(float(ratio) > 0 for _, ratio in speedups)
    bandwidth = re.search(rf"streaming bandwidth \(a large copy: .* the run's best, ({NUMBER}) GB/s", out)
    assert bandwidth is not None and float(bandwidth.group(1)) > 0
    # Each step against the copy timed just before it, and against the run's best copy (a floor no higher).
    floors = re.findall(rf"batch\s+(\d+)\s+float32: ({NUMBER}) kB/token, floor ({NUMBER}) ms/step at ({NUMBER}) GB/s, "
                        rf"step at ({NUMBER})% of the floor's speed \(({NUMBER})% against the run's best copy\)", out)
    assert [batch for batch, *_ in floors] == ["2", "8"]
    for _, kb, _, copy_gb_s, share, strict_share in floors:
        assert float(kb) > 0 and 0 < float(copy_gb_s) <= float(bandwidth.group(1))
        assert 0 < float(strict_share) <= float(share)
    assert "8 ms at 256" in out


def test_the_structured_outputs_benchmark_reports_compiles_masks_and_both_throughputs() -> None:
    out = run_benchmark("structured.py", "--quick", "--batch", "4", "--max-tokens", "12", "--compiles", "2",
                        "--repeats", "1")
    assert "a fresh matcher each, no cache" in out
    assert len(re.findall(rf"^\s+\w+\s+median\s+{NUMBER} ms$", out, re.M)) >= 15  # one line per shipped schema
    assert re.search(rf"compile p50: {NUMBER} ms  p99: {NUMBER} ms  \[target p99 <= 20 ms: (met|NOT met)\]", out)
    assert re.search(rf"compile CPU time \(the compiling thread's\): p50 {NUMBER} ms  p99 {NUMBER} ms", out)
    assert re.search(rf"the step loop's time per constrained arrival \(its compile on a worker thread\): "
                     rf"p50 {NUMBER} us  p99 {NUMBER} us, against the compile's own p99 {NUMBER} ms", out)
    mask = re.search(rf"per-step mask cost: ({NUMBER}) us a step, {NUMBER} us a row \((\d+) rows in (\d+) steps\)", out)
    assert mask and float(mask.group(1)) > 0 and int(mask.group(2)) >= int(mask.group(3)) > 0
    plain = re.search(rf"unconstrained:\s+{NUMBER} output tokens/s \((\d+) tokens", out)
    constrained = re.search(rf"json_schema:\s+{NUMBER} output tokens/s \((\d+) tokens", out)
    assert plain and constrained and plain.group(1) == constrained.group(1)  # the same work in both runs
    assert re.search(rf"ratio json_schema / unconstrained at batch 4: {NUMBER}  \[target >= 0.85: (met|NOT met)\]", out)
    assert re.search(rf"same ratio by this process's CPU time: {NUMBER} ", out)


def test_the_speculative_benchmark_reports_acceptance_and_both_throughputs_on_the_same_requests() -> None:
    out = run_benchmark("speculative.py", "--batches", "1", "--requests", "2", "--max-tokens", "12", "--k", "3",
                        "--candidates", "6", "--repeats", "1")
    assert re.search(r"\d+ of 6 random prompts \(\d+%\) have a greedy continuation that repeats", out)
    # (a), the target as its own draft and oracle drafts: every draft accepted (fewer than k are drafted
    # only where max_tokens leaves less room)
    accepted = re.findall(rf"acceptance rate ({NUMBER})%  mean accepted length ({NUMBER}) of 3", out)
    assert len(accepted) == 3 and all(float(rate) == 100.0 and 2.0 < float(length) <= 3.0
                                      for rate, length in accepted[:2])
    assert len(re.findall(rf"plain:\s+{NUMBER} output tokens/s\s+{NUMBER} ms per output token", out)) >= 1
    ratios = re.findall(rf"ratio speculative / plain: {NUMBER}x   tokens identical to plain: (yes|NO)", out)
    assert ratios and set(ratios) == {"yes"}
    assert len(re.findall(r"draft at \d+% of the target per token: break-even", out)) == 4


def gpu_session(*arguments: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_session.py"), *arguments], cwd=REPO,
                          env=environment, capture_output=True, text=True, timeout=300)


def test_the_gpu_session_runs_its_stages_keeps_their_logs_and_starts_none_it_has_no_time_for(tmp_path) -> None:
    out, wheels = tmp_path / "out", tmp_path / "no-wheels"
    wheels.mkdir()
    result = gpu_session("--out", str(out), "--wheels", str(wheels), "--budget", "100", "kernels", "engine-1b")
    assert result.returncode == 1, result.stderr[-2000:]  # a stage was left out: the call is not all done
    assert re.search(rf"zero_blocks vs memset: {NUMBER}%", result.stdout)  # a result line, printed as it ended
    assert "device: CPU (torch reference path)" in (out / "kernels.log").read_text()
    summary = (out / "summary.txt").read_text().splitlines()
    assert re.fullmatch(r"kernels +ok in \d+ s", summary[0])
    limit = stages()["engine-1b"].limit_s
    assert summary[1].startswith(f"engine-1b  not started: its {limit} s limit exceeds the")
    assert not (out / "engine-1b.log").exists()


def test_a_narrowed_gpu_test_run_selects_by_name_under_a_limit_of_its_own() -> None:
    result = gpu_session("--dry-run", "--tests-k", "crossings or residue", "tests", "parity")
    tests_line, parity_line = result.stdout.splitlines()
    assert result.returncode == 0 and tests_line.endswith("-k crossings or residue")
    assert re.match(r"tests +60 s", tests_line) and re.match(rf"parity +{stages()['parity'].limit_s} s", parity_line)


def test_the_gpu_decode_measurement_leaves_every_sequence_decoding_through_its_steps() -> None:
    """A large batch prefills over several steps while its first sequences already decode; each must
    still be decoding when the timed steps end, so that the benchmark's aborts find it (on the H100, a
    batch of 256 finished early and the abort was refused)."""
    from benchmarks.engine_gpu import start_decoding, stop_decoding
    from engine import EngineConfig, LLMEngine
    from tests.engine_models import VOCAB_SIZE, tiny_model_dir

    engine = LLMEngine(tiny_model_dir(), EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, num_blocks=256))
    steps = 4
    requests = start_decoding(engine, 16, 40, steps, VOCAB_SIZE)  # 640 prompt tokens: ten prefill steps
    for _ in range(steps):
        engine.step()
    assert len(engine.scheduler.running) == len(requests)  # none finished early
    stop_decoding(engine, requests)
    assert not engine.has_unfinished()


def test_the_gpu_session_refuses_a_stage_it_does_not_know() -> None:
    result = gpu_session("--dry-run", "kernels", "engine-2b")
    assert result.returncode == 2 and "unknown stage(s): engine-2b" in result.stderr


def test_the_gpu_sessions_calls_fit_their_budgets_and_pass_only_options_the_gpu_benchmark_takes() -> None:
    from benchmarks.gpu_session import __doc__ as usage
    from benchmarks.gpu_session import gpu_test_files, stages

    known = stages()
    calls = [line.split()[5:] for line in usage.splitlines() if "gpu_session.py --out $OUT --budget" in line]
    assert len(calls) == 2 and sorted(name for call in calls for name in call[1:]) == sorted(known)
    for budget, *names in calls:
        assert sum(known[name].limit_s for name in names) < float(budget) - 30  # room for the wheels' install
    assert "tests/test_engine_crossings.py" in gpu_test_files() and "tests/test_benchmarks.py" not in gpu_test_files()
    # In a process of its own: the script puts the repository first on sys.path as it is imported.
    check = "import sys\nfrom benchmarks.engine_gpu import parse_args\nparse_args(sys.argv[1:])\n"
    for stage in known.values():
        if stage.argv[0] == "benchmarks/engine_gpu.py":
            parsed = subprocess.run([sys.executable, "-c", check, *stage.argv[1:]], cwd=REPO, capture_output=True,
                                    text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
            assert parsed.returncode == 0, (stage.name, parsed.stderr[-1000:])


def test_the_preemption_benchmark_prints_the_prefill_redone_against_the_minimum() -> None:
    out = run_benchmark("engine_preemption.py", "--requests", "12", "--pool-blocks", "40")
    assert re.search(rf"full pool \(40 blocks of 4 tokens\): preemptions \d+, tokens computed again \d+", out)
    assert re.search(rf"recomputed prefill tokens / minimum: {NUMBER}x", out)
    assert re.search(rf"prefill work / minimum: {NUMBER}x", out)
    assert re.search(rf"blocks zeroed / baseline: {NUMBER}x", out)


def test_the_embeddings_benchmark_compares_both_batch_sizes_with_transformers() -> None:
    out = run_benchmark("embeddings.py", "--quick", "--inputs", "6", "--batch", "4", "--repeats", "1", "--threads", "1")
    assert re.search(rf"vectors: Veil's equal transformers' \(lowest cosine {NUMBER}\)", out)
    for batch in (1, 4):
        for side in ("transformers", "veil"):
            rate = re.search(rf"batch\s+{batch} {side}:\s+({NUMBER}) inputs/s\s+({NUMBER}) tokens/s", out)
            assert rate and float(rate.group(1)) > 0 and float(rate.group(2)) > float(rate.group(1)), (batch, side)
        assert re.search(rf"batch\s+{batch} ratio veil / transformers: {NUMBER}x\s+\(best of each", out)


def gpu_tests(folder: Path, *arguments: str) -> subprocess.CompletedProcess:
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n    gpu_alone: alone\n")
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_tests.py"), "--out", str(folder / "out"),
                           *arguments], cwd=folder, capture_output=True, text=True, timeout=600)


def test_the_gpu_tests_are_dealt_out_to_workers_and_summed_up_with_every_test_that_did_not_pass(tmp_path) -> None:
    (tmp_path / "test_dealt.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "def test_one(): pass\n"
        "def test_two(): pass\n"
        "def test_three(): pass\n"
        "def test_fails(): assert False\n"
        "def test_skips(): pytest.skip('no device')\n"
        "@pytest.mark.parametrize('width', [1, 2])\n"
        "def test_shapes(width): pass\n"
        "@pytest.mark.gpu_alone\n"
        "def test_alone(): pass\n")
    (tmp_path / "test_not_gpu.py").write_text("def test_left_out(): pass\n")
    # The deadline only bounds a hang: the tests themselves take no time.
    result = gpu_tests(tmp_path, "--workers", "3", "--deadline-s", "500", "test_dealt.py", "test_not_gpu.py")
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert "gpu tests: 6 passed, 1 failed, 0 errors, 1 skipped, 0 not run, of 8 collected" in result.stdout
    assert "  failed: test_dealt.py::test_fails\n" in result.stdout
    assert "deadline reached" not in result.stdout and "test_left_out" not in result.stdout
    logs = sorted((tmp_path / "out").glob("tests-*.log"))
    assert [log.name for log in logs] == ["tests-0.log", "tests-1.log", "tests-2.log", "tests-3.log"]
    ran = [[line.split()[0] for line in log.read_text().splitlines() if re.match(r"\S+::\S+ (PASSED|FAILED|SKIPPED)", line)]
           for log in logs]
    assert ran[0] == ["test_dealt.py::test_alone"]  # first, in a worker of its own
    assert sorted(sum(ran[1:], [])) == sorted(f"test_dealt.py::test_{name}" for name in
                                              ("one", "two", "three", "fails", "skips", "shapes[1]", "shapes[2]"))


def test_gpu_test_workers_still_running_at_the_deadline_are_killed_and_their_tests_reported_not_run(tmp_path) -> None:
    (tmp_path / "test_hangs.py").write_text(
        "import os, time, pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "@pytest.mark.parametrize('index', range(4))\n"
        "def test_hangs(index, tmp_path_factory):\n"
        f"    open({str(tmp_path)!r} + f'/pid-{{os.getpid()}}', 'w').close()\n"
        "    time.sleep(3600)\n")
    result = gpu_tests(tmp_path, "--workers", "2", "--deadline-s", "3", "test_hangs.py")
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert "gpu tests: 0 passed, 0 failed, 0 errors, 0 skipped, 4 not run, of 4 collected" in result.stdout
    assert "deadline reached: worker(s) 0, 1 killed" in result.stdout
    assert result.stdout.count("  not run: test_hangs.py::test_hangs[") == 4
    for marker in tmp_path.glob("pid-*"):  # whichever worker reached its test before the deadline is gone
        with pytest.raises(ProcessLookupError):
            os.kill(int(marker.name.removeprefix("pid-")), 0)
