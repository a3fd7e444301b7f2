"""The command line and the gateway load without torch: `npu-llm --help` answers at once, and the gateway
process (an HTTP front end) keeps torch's few hundred MB out of its imports."""
from __future__ import annotations

import subprocess
import sys


def test_the_cli_and_the_gateway_modules_do_not_import_torch():
    code = ("import sys, backend.entrypoints.cli, backend.gateway.app, backend.triton.contract; backend.entrypoints.cli.build_parser(); "
            "loaded = [m for m in ('torch', 'torch_npu') if m in sys.modules]; assert not loaded, loaded")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_a_qwen_v1_tokenizer_loads_without_torch(tmp_path):
    """The gateway's tokenizer for a Qwen (v1) folder: its tiktoken vocabulary, converted without torch."""
    import base64

    (tmp_path / "qwen.tiktoken").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n"
                                                    for b in range(256)))
    code = (f"import sys; from backend.engine.tokenizer import load_template_tokenizer; "
            f"t = load_template_tokenizer({str(tmp_path)!r}); assert t.encode('hi') == [104, 105], t.encode('hi'); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_a_started_gateway_has_not_imported_torch():
    """The whole start-up: the default model's tokenizer (chat template) loaded and the app built."""
    code = ("import sys; from backend.gateway.app import GatewaySettings, create_app; create_app(GatewaySettings()); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
