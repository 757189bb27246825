"""Writes ``comet_reference.json``: unbabel-comet's own scores of the tiny COMET models of
``tests/helpers/tiny_comet.py``, which ``aiayn.evaluation.comet`` must reproduce. unbabel-comet cannot be
installed beside aiayn (it pins numpy<2, torchmetrics<0.11 and protobuf<5), so this runs in an environment
of its own, on folders the project's environment wrote:

    python -m venv /tmp/comet && /tmp/comet/bin/pip install torch==2.13.0 unbabel-comet==2.2.7
    for v in sparsemax softmax_norm layer1_cls layer2_max sparsemax_patch deep; do
        PYTHONPATH=tests/helpers python tests/helpers/tiny_comet.py /tmp/tiny_comet/$v $v; done
    PYTHONPATH=tests/helpers /tmp/comet/bin/python tests/assets/comet_reference.py /tmp/tiny_comet
"""

import json
import os
import sys
from importlib.metadata import version
from pathlib import Path

from comet import load_from_checkpoint
from tiny_comet import SAMPLES, VARIANTS

root = Path(sys.argv[1]).resolve()
record = {"unbabel-comet": version("unbabel-comet"), "transformers": version("transformers"), "scores": {}}
for name in VARIANTS:
    os.chdir(root / name)  # the models name their encoder "encoder", which unbabel-comet reads from here
    model = load_from_checkpoint(str(root / name / "checkpoints" / "model.ckpt"), local_files_only=True)
    # Batches of 4 over 6 samples: padding inside a batch, a last batch of 2, COMET's length sorting.
    prediction = model.predict(SAMPLES, batch_size=4, gpus=0, progress_bar=False)
    record["scores"][name] = {"segments": list(prediction.scores), "system": prediction.system_score}
out = Path(__file__).with_name("comet_reference.json")
out.write_text(json.dumps(record, indent=1) + "\n")
