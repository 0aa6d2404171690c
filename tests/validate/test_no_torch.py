"""The validate layer imports without torch; only running ranks needs it."""

from __future__ import annotations

import subprocess
import sys


def test_validate_modules_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any 'import torch' now fails
        "import collsim.validate.measure.launch, collsim.validate.measure.bench\n"
        "import collsim.validate.data.dataset\n"
        "import collsim.validate.fit.calibrate, collsim.validate.check.compare\n"
        "import collsim.validate.measure.sketch, collsim.validate.check.step\n"
        "import collsim.validate.measure.step, collsim.cli.validate\n"
        "from click.testing import CliRunner\n"
        "from collsim.cli import cli\n"
        "r = CliRunner().invoke(cli, ['validate', '--help'])\n"
        "assert r.exit_code == 0 and 'holdout' in r.output, r.output\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
