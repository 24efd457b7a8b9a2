"""One JSON and one Markdown table from a gpu_truth.sh work folder: the device, driver and torch; every stage's
exit status; the measured ceilings; every test's and notebook's outcome and time; the bench's figures, each with
its unit; the capstone's result. Nothing is typed in: every figure is read from a file a stage wrote.

    python tools/gpu_truth_report.py runs/gpu-truth --out results/gpu [--dry]
"""
import argparse
import json
import re
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def first_error_line(text: str) -> str:
    """The line that names the error ("RankFailed: ...", "AssertionError: ..."), else the first line."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m|#x1B\[[0-9;]*m", "", text).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Failed|Timeout|Interrupted)\b.*:", line)]
    return ((named or lines or [""])[-1 if named else 0])[:400]


def junit_cases(path: Path) -> list[dict]:
    """Each test case of a junit XML: name, outcome (passed, failed, error, skipped), seconds, the error's line."""
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # pytest-xdist writes one empty testcase per run: no test
            continue
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = first_error_line(child.get("message") or child.text or "")
                break
        name = case.get("name", "")
        if case.get("classname"):
            name = f"{case.get('classname')}::{name}"
        cases.append({"name": name, "outcome": outcome, "seconds": round(float(case.get("time") or 0), 1),
                      "message": message})
    return cases


def counts(cases: list[dict]) -> dict:
    result = {k: 0 for k in ("passed", "failed", "error", "skipped", "no result")}
    for case in cases:
        result[case["outcome"]] += 1
    return result


def bench_rows(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("*.json")):
        run = read_json(path)
        if not run:
            continue
        config = run["config"]
        rows.append({
            "name": path.stem, "model": config["model"], "batch_size": config["batch_size"],
            "image_size": config["image_size"], "precision": config["precision"],
            "channels_last": config["channels_last"], "compile_requested": config["compile"],
            "compiled": run["compiled"], "compile_reason": run["compile_reason"],
            "images_per_s": {"value": run["images_per_s"], "unit": "images/s"},
            "step_s": {"value": run["split"]["step_s"], "unit": "s (median step)"},
            "achieved_tflops": {"value": run["achieved_tflops_per_rank"], "unit": "TFLOP/s"},
            "peak_tflops": {"value": run["peak_tflops"], "unit": "TFLOP/s (datasheet, dense)"},
            "mfu": {"value": run["mfu"], "unit": "fraction of peak_tflops"},
            "peak_memory": {"value": run["peak_memory_bytes"], "unit": "bytes", "kind": run["peak_memory_kind"]},
            "device_name": run["provenance"].get("device_name"),
        })
    return rows


def capstone_result(work: Path) -> dict | None:
    summaries = sorted((work / "runs").glob("capstone/*/summary.json"))
    if not summaries:
        return None
    summary = read_json(summaries[-1]) or {}
    keep = {k: v for k, v in summary.items() if not isinstance(v, (list, dict)) or k in ("schedule",)}
    return {"run": str(summaries[-1].parent.relative_to(work)), **keep}


def run_at(work: Path) -> str:
    """When the kit ran there: its start (its marker file), else the end of its last stage (older work folders)."""
    for marker in (work / ".started", work / "stages.jsonl", work):
        if marker.exists():
            return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(marker.stat().st_mtime))
    return "unknown"


def build(work: Path, dry: bool) -> dict:
    doctor = read_json(work / "doctor.json") or {}
    probe = read_json(work / "probe.json") or {}
    stages = [json.loads(line) for line in (work / "stages.jsonl").read_text().splitlines() if line.strip()] \
        if (work / "stages.jsonl").exists() else []
    notebooks = {}
    for path in sorted(work.glob("notebooks-*.xml")):
        cases = junit_cases(path)
        requested = path.with_suffix(".requested")
        if requested.exists():  # a notebook the stage was stopped before it finished has no testcase
            finished = {case["name"].split("::")[-1] for case in cases}
            cases += [{"name": Path(line).name, "outcome": "no result", "seconds": 0.0,
                       "message": "the stage's time limit stopped it before it finished"}
                      for line in requested.read_text().split() if Path(line).name not in finished]
        notebooks[path.stem.removeprefix("notebooks-")] = {"counts": counts(cases), "cases": cases}
    tests = junit_cases(work / "tests.xml")
    gpus = doctor.get("gpus") or []
    bench = bench_rows(work / "bench")
    provenance = next((read_json(p) or {} for p in sorted((work / "bench").glob("*.json"))), {}).get("provenance", {})
    doctor = {"torch": provenance.get("torch"), "torchvision": provenance.get("torchvision"),
              "cuda_build": provenance.get("cuda"), "python": provenance.get("python"),
              "platform": provenance.get("platform"), **{k: v for k, v in doctor.items() if v is not None}}
    return {
        "kit": "tools/gpu_truth.sh", "dry_run": dry, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run_at": run_at(work),
        "device": probe.get("device_name") or (gpus[0].get("name") if gpus and isinstance(gpus[0], dict) else None)
        or (provenance.get("device_name") if provenance.get("device", "cpu") != "cpu" else None) or "no GPU",
        "nvidia_smi": probe.get("nvidia_smi"), "torch": doctor.get("torch"), "torchvision": doctor.get("torchvision"),
        "cuda_build": doctor.get("cuda_build"), "python": doctor.get("python"), "platform": doctor.get("platform"),
        "stages": stages, "doctor": doctor, "ceilings": probe,
        "tests": {"counts": counts(tests), "cases": tests},
        "notebooks": notebooks, "bench": bench, "capstone": capstone_result(work),
    }


def fmt(value, digits=0):
    return "—" if value is None else f"{value:,.{digits}f}"


def markdown(report: dict, json_name: str) -> str:
    lines = [f"# GPU truth run: {report['device']}", "",
             f"`tools/gpu_truth.sh`, run at {report['run_at']}; torch {report['torch']} (CUDA {report['cuda_build']}), "
             f"Python {report['python']}; nvidia-smi: {report['nvidia_smi'] or '—'}. Every figure below is read "
             f"from [{json_name}]({json_name}), which the kit wrote.", ""]
    if report["dry_run"]:
        lines += ["**Dry run** (a rehearsal without a GPU): the figures are CPU figures.", ""]
    c = report["ceilings"]
    if c.get("cuda"):
        lines += ["## Measured ceilings", "",
                  f"- device-to-device copy: {c['copy']['tb_per_s']:.2f} TB/s (bytes read plus bytes written)",
                  f"- 8192³ matrix product, bf16: {c['matmul_bf16']['tflop_per_s']:.0f} TFLOP/s; "
                  f"fp32 inputs in tf32 mode: {c['matmul_tf32']['tflop_per_s']:.0f} TFLOP/s", ""]
    if report["bench"]:
        lines += ["## Bench (`python -m labsrc.bench`, one GPU, data resident on the device)", "",
                  "| run | model | batch | precision | channels_last | compiled | images/s | TFLOP/s | MFU | peak memory (GiB) |",
                  "|---|---|---:|---|---|---|---:|---:|---:|---:|"]
        for r in report["bench"]:
            mfu = r["mfu"]["value"]
            lines.append(
                f"| {r['name']} | {r['model']} {r['image_size']}px | {r['batch_size']} | {r['precision']} | "
                f"{'yes' if r['channels_last'] else 'no'} | "
                f"{'yes' if r['compiled'] else ('no: ' + r['compile_reason'] if r['compile_requested'] else 'no')} | "
                f"{fmt(r['images_per_s']['value'])} | {fmt(r['achieved_tflops']['value'], 1)} | "
                f"{'—' if mfu is None else f'{mfu:.1%}'} | {fmt(r['peak_memory']['value'] / 2**30, 1)} |")
        lines += ["", "MFU: achieved over the datasheet's dense peak for the precision (labsrc/training/benchmark.py "
                  "cites the datasheets); the matrix product above is the ceiling measured on this card.", ""]
    for profile, nb in report["notebooks"].items():
        k = nb["counts"]
        lines += [f"## Notebooks, {profile} profile: {k['passed']} passed, {k['failed'] + k['error']} failed, "
                  f"{k['skipped']} skipped" + (f", {k['no result']} without a result" if k["no result"] else ""), "", "| notebook | outcome | seconds | error |", "|---|---|---:|---|"]
        for case in nb["cases"]:
            name = re.sub(r"^.*?notebooks[/.:]+", "", case["name"])
            lines.append(f"| {name} | {case['outcome']} | {case['seconds']:.0f} | {case['message'].replace('|', '/')} |")
        lines.append("")
    t = report["tests"]["counts"]
    if any(t.values()):
        lines += [f"## GPU unit tests: {t['passed']} passed, {t['failed'] + t['error']} failed, {t['skipped']} skipped", ""]
        for case in report["tests"]["cases"]:
            if case["outcome"] in ("failed", "error"):
                lines.append(f"- {case['name']}: {case['message']}")
        lines.append("")
    if report["capstone"]:
        cap = report["capstone"]
        shown = {k: v for k, v in cap.items() if isinstance(v, (int, float, str)) and k != "run"}
        lines += ["## Capstone (gpu profile, synthetic CIFAR-sized data)", "",
                  ", ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in shown.items()), ""]
    lines += ["## Stages", "", "| stage | exit | seconds |", "|---|---:|---:|"]
    lines += [f"| {s['stage']} | {s['rc']} | {s['seconds']} |" for s in report["stages"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry", action="store_true")
    args = parser.parse_args(argv)
    report = build(args.work, args.dry)
    args.out.mkdir(parents=True, exist_ok=True)
    when = re.sub(r"[-:]", "", report["run_at"])[:13].replace("T", "-")  # 20261126-0014
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{when}-{report['device']}").strip("-")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report, f"{stem}.json"))
    print(markdown(report, f"{stem}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
