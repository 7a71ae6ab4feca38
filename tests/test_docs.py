"""The documentation as a product: the site builds strictly, generated pages are current, every README
figure has a source that holds its value, and the commands, modules, config keys and HTTP routes the
pages name exist.

`mkdocs build --strict` fails on a broken link or anchor (mkdocs.yml's `validation`) and on a
mkdocstrings reference that no longer resolves. The figure checks use benchmarks/figures.py; the
generated pages are written by docs/gen_pages.py.
"""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, os.path.join(REPO, "docs"))
import figures  # noqa: E402
import gen_pages  # noqa: E402

WRITTEN_PAGES = sorted(set(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
                       - {os.path.join(REPO, p) for p in gen_pages.PAGES})


def _read(path: str) -> str:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def _clean_env() -> dict[str, str]:
    """This process's environment without the suite's 8 fake devices, for a child that runs as a user would."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    return env


def test_mkdocs_build_is_strict_clean_and_renders_the_generated_pages(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             os.path.join(REPO, "mkdocs.yml"), "--site-dir", str(site)],
                            cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    config_html = (site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    assert "rl.advantage" in config_html and "rl.kl_estimator" in config_html
    api_html = (site / "reference" / "python-api" / "index.html").read_text(encoding="utf-8")
    assert "load_trained" in api_html  # mkdocstrings rendered rlvr.api
    bench_html = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert "rollout_vs_tunix.json" in bench_html
    # docs/hooks.py: a page's figure links point at their results file's section of that page
    tunix_html = (site / "how-to" / "train-step-vs-tunix" / "index.html").read_text(encoding="utf-8")
    assert 'href="../../benchmarks/#hugepagesjson" title="hugepages.json: ours_vs_tunix.huge"' in tunix_html
    assert 'id="hugepagesjson"' in bench_html


def test_generated_pages_are_current():
    assert gen_pages.stale() == [], "run: python docs/gen_pages.py"


def test_every_readme_figure_has_a_source_holding_its_value():
    failing = figures.check("README.md")
    assert not failing, "\n".join(f"README.md:{f.line} {f.text!r} {f.file}:{f.key}: {f.error}" for f in failing)
    sourced = [f for f in figures.figures(_read("README.md")) if f.file]
    assert len(sourced) >= 10  # the benchmark table is there, and every one of its figures was checked


def test_every_figure_of_the_written_pages_has_a_source_holding_its_value():
    """The README's rule on every written docs page: a measured figure links its results file and key
    (docs/hooks.py points the link at the benchmarks page on the site); a constant goes in a code span."""
    pages = [os.path.relpath(p, REPO) for p in WRITTEN_PAGES]
    failing = [(page, f) for page in pages for f in figures.check(page)]
    assert not failing, "\n".join(f"{page}:{f.line} {f.text!r} {f.file}:{f.key}: {f.error}" for page, f in failing)
    sourced = [page for page in pages if figures.FIGURE_LINK.search(_read(page))]
    benchmark_howtos = {f"docs/how-to/{name}.md" for name in ("train-step-vs-tunix", "start-up-time", "sandbox-pool",
                                                              "rollout-fleet", "check-a-job-fits")}
    assert benchmark_howtos <= set(sourced), sourced  # they quote their figures as links


def test_the_figure_checker_fails_unsourced_wrong_and_undated_figures(tmp_path, monkeypatch):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "ok.json").write_text(json.dumps(
        {"date": "2026-12-01", "command": "python b.py", "machine": "2 CPUs", "runs": [{"x": 0.53125, "n": 1234.4}]}))
    (results / "bare.json").write_text(json.dumps({"x": 2.0}))
    monkeypatch.setattr(figures, "REPO", str(tmp_path))
    text = ("[0.531](benchmarks/results/ok.json \"runs.0.x\"), [53.1 %](benchmarks/results/ok.json \"runs.0.x *100\"),"
            " [1,234 tokens/s](benchmarks/results/ok.json \"runs.0.n\") on 8 × 256 rows, `3.5 s` in code\n"
            "[0.54](benchmarks/results/ok.json \"runs.0.x\") [1](benchmarks/results/ok.json \"runs.1.x\")"
            " [2](benchmarks/results/bare.json \"x\") and 0.539 or 2.5× unsourced\n"
            "```\n4.0 s in a code block\n```\n")
    found = figures.figures(text)
    assert [(f.line, f.text) for f in found if not f.error] == [(1, "0.531"), (1, "53.1 %"), (1, "1,234 tokens/s")]
    errors = {f.text: f.error for f in found if f.error}
    assert set(errors) == {"0.54", "1", "2", "0.539", "2.5×"}
    assert "shows 0.54, the file has 0.53125" in errors["0.54"]
    assert "not an index" in errors["1"]
    assert errors["2"] == "the record has no date, command, machine"
    assert errors["0.539"].startswith("no source") and errors["2.5×"].startswith("no source")


def test_readme_links_resolve_and_it_stays_short():
    readme = _read("README.md")
    assert len(readme.splitlines()) <= 250
    prose = "\n".join(line for _, line in figures._prose(readme))  # links outside code
    targets = re.findall(r"\]\(([^)\s]+)(?: \"[^\"]*\")?\)", prose)
    assert targets
    missing = [t for t in targets if "://" not in t and not os.path.exists(os.path.join(REPO, t.split("#")[0]))]
    assert not missing, missing


@pytest.mark.slow
def test_readme_example_runs():
    [example] = re.findall(r"```python\n(.*?)```", _read("README.md"), re.DOTALL)
    result = subprocess.run([sys.executable, "-c", example], cwd=REPO, env=_clean_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 4 and all("'reward':" in line and "->" in line for line in lines), result.stdout


@pytest.mark.slow
def test_python_api_pages_job_example_runs(tmp_path):
    """The reference page's 'a job as rlvr.main runs it' block: resolve once, hand the Job to a trainer."""
    [example] = [b for b in re.findall(r"```python\n(.*?)```", _read("docs/reference/python-api.md"), re.DOTALL)
                 if "job.resolve" in b]
    example = example.replace('"workdirs/tiny"', repr(str(tmp_path / "tiny"))) + "\nprint(summary['final_step'])\n"
    result = subprocess.run([sys.executable, "-c", "from rlvr import api\n" + example], cwd=REPO, env=_clean_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "20"
    assert (tmp_path / "tiny" / "checkpoints").is_dir() and (tmp_path / "tiny" / "tokenizer").is_dir()


def _documented_text() -> str:
    """README.md and every written page (not the generated ones)."""
    return "\n".join([_read("README.md"), *(_read(p) for p in WRITTEN_PAGES)])


def _schema_keys() -> set[str]:
    from rlvr import config as config_cli
    from rlvr import config_lib

    keys = set()
    for key, _, _ in config_cli._leaves(config_lib.base_config()):
        parts = key.split(".")
        keys |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return keys


def test_documented_modules_config_files_and_keys_exist():
    text = _documented_text()
    modules = set(re.findall(r"python -m ((?:rlvr)(?:\.\w+)*)", text))
    assert {"rlvr.main", "rlvr.export", "rlvr.rollout.server", "rlvr.flywheel"} <= modules
    missing_modules = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert not missing_modules, missing_modules

    paths = {p for p in re.findall(r"((?:configs|benchmarks|tests)/[\w/.\-]+\.(?:py|json))", text)
             if not re.search(r"/[A-Z_]+\.", p)}  # configs/NAME.py: a placeholder
    missing_paths = sorted(p for p in paths if not os.path.exists(os.path.join(REPO, p)))
    assert not missing_paths, missing_paths

    keys = {k for k in re.findall(r"--config\.([\w.]+)=", text) if not k.isupper()}  # KEY: a placeholder
    assert "train.num_steps" in keys and "rl.advantage" in keys
    unknown = sorted(keys - _schema_keys() - {"data.batch_sise"})  # the quickstart's example of a typo
    assert not unknown, f"--config.KEY on the pages that the schema lacks: {unknown}"


def _server_routes() -> set[str]:
    server = _read("rlvr/rollout/server.py")
    block = server[server.index("self.routes: dict"):server.index("self.routes.update(routes or {})")]
    routes = set(re.findall(r'"(/[\w/]+)": \(\{', block))
    routes |= {prefix + path for path in re.findall(r'prefix \+ "(/\w+)"', block) for prefix in ("", "/v1")}
    routes |= set(re.findall(r'return \{"(/[\w/]+)": ', _read("rlvr/flywheel/capture.py")))
    return routes | {"/v1/models/{id}", "/sessions/<id>/v1/..."}


def test_http_api_page_lists_exactly_the_server_routes():
    page = _read("docs/reference/http-api.md")
    rows = [line for line in page.splitlines() if re.match(r"\| (?:[A-Z, ]+|any) \|", line)]
    documented = {path for row in rows for path in re.findall(r"`(/[^`]*)`", row)}
    routes = _server_routes()
    assert "/generate" in routes and "/v1/feedback" in routes
    assert routes - documented == set(), f"routes the page does not list: {sorted(routes - documented)}"
    assert documented - routes == set(), f"paths the server does not serve: {sorted(documented - routes)}"


def test_every_config_a_tutorial_runs_is_run_by_a_test():
    """The bring-your-own-model commands run as written (tests/test_byo_model.py); the other tutorials'
    `rlvr.main` commands are too long for the suite, so each config they name must be one that a test
    runs (its smoke or tiny variant), and the checks above keep their modules and keys real."""
    tests = "\n".join(_read(p) for p in glob.glob(os.path.join(REPO, "tests", "test_*.py")))
    configs = set()
    for page in glob.glob(os.path.join(REPO, "docs", "tutorials", "*.md")):
        if page.endswith("bring-your-own-model.md"):
            continue  # run as written
        for block in re.findall(r"```bash\n(.*?)```", _read(page), re.DOTALL):
            configs |= set(re.findall(r"rlvr\.main --config=(configs/[\w/]+\.py)", block))
    assert {"configs/tiny.py", "configs/agentic_tools.py", "configs/finance_docs.py"} <= configs
    untested = sorted(c for c in configs if c not in tests)
    assert not untested, f"tutorial configs no test runs: {untested}"
