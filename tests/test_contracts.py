"""The topic specs and event schemas ship with the package (issue 40 item 5).

An editable install reads the checkout's ``topics/`` and ``schemas/``; a wheel carries a copy
under ``pipeline/_contracts/``. The second test builds the wheel, installs it (not editable) in
a fresh virtual environment whose only view of this checkout is the dependencies' folder, and
runs the CLI and an event round trip from outside the checkout: before, the wheel had 175
files and no spec or schema, and such an install could not start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from pipeline.contracts import contracts_dir
from pipeline.events.validation import schemas_dir
from pipeline.kafka.names import ALL, SPECS_DIR

ROOT = Path(__file__).resolve().parents[1]


def test_an_editable_install_reads_the_checkouts_folders() -> None:
    assert contracts_dir("topics") == ROOT / "topics" == SPECS_DIR
    assert contracts_dir("schemas") == ROOT / "schemas" == schemas_dir()
    assert len(ALL) == len(list((ROOT / "topics").glob("*.yaml")))


_CHECK = """
import json, sys
from pathlib import Path
import pipeline
from pipeline.contracts import contracts_dir
from pipeline.events import decode, encode
from pipeline.events.examples import examples
from pipeline.kafka.names import ALL
from pipeline.kafka.topics import load_specs
trips = 0
for name, ev in examples().items():
    assert decode(encode(ev), expected_type=ev.type) == ev, name
    trips += 1
print(json.dumps({"package": pipeline.__file__, "topics": str(contracts_dir("topics")),
                  "schemas": str(contracts_dir("schemas")), "declared": len(ALL),
                  "specs": len(load_specs(contracts_dir("topics"))), "trips": trips}))
"""


def test_a_wheel_installed_outside_the_checkout_has_its_contracts(tmp_path: Path) -> None:
    # Built from a copy of the checkout's files (tracked or not ignored): building in place
    # leaves build/ behind, whose stale copies of deleted modules a later wheel would carry.
    src, dist = tmp_path / "src", tmp_path / "dist"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = dist.glob("liverl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for kind, pattern in (("topics", "*.yaml"), ("schemas", "*.json")):
        expected = {f"pipeline/_contracts/{kind}/{p.name}" for p in (ROOT / kind).glob(pattern)}
        assert expected and expected <= names, f"{kind} missing from the wheel"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # The dependencies come from this environment's folder; a path listed in a .pth file has
    # its own .pth files ignored, so this checkout's editable finder is not installed there.
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL_") and k != "PYTHONPATH"}
    env["LIVERL_STATE_DIR"] = str(tmp_path / "state")
    helped = subprocess.run(
        [str(venv / "bin" / "liverl"), "topics", "list", "--help"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert helped.returncode == 0, helped.stderr
    out = subprocess.run(
        [str(py), "-c", _CHECK], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    installed = Path(site).resolve()
    assert Path(got["package"]).resolve().is_relative_to(installed)  # the wheel, not the checkout
    assert Path(got["topics"]).resolve() == installed / "pipeline" / "_contracts" / "topics"
    assert Path(got["schemas"]).resolve() == installed / "pipeline" / "_contracts" / "schemas"
    assert got["declared"] == got["specs"] == len(list((ROOT / "topics").glob("*.yaml")))
    assert got["trips"] == len(list((ROOT / "schemas").glob("*.v1.json")))
