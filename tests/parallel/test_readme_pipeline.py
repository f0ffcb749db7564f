"""The README's pipeline example runs, and trains to the un-pipelined loss."""

import re
from pathlib import Path

import numpy as np

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_pipeline_example_runs(capsys):
    after = README.split("<!-- pipeline-example -->", 1)[1]
    block = re.search(r"```python\n(.*?)```", after, flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert out.startswith("P('stage', None, None)\n")
    np.testing.assert_allclose(
        float(namespace["metrics"]["loss"]), float(namespace["want"]), rtol=1e-5
    )
