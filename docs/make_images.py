"""Regenerate the pictures of the docs (gallery and guides): run each example in full and save a small copy here.

Run:  python docs/make_images.py      (about a minute on 2 CPU cores; needs matplotlib)
      python docs/make_images.py loss_paths.py   (only the pictures of the examples named)

The examples write full-size PNGs to a temporary folder; each is scaled down
and reduced to a 128-colour palette (Pillow, which matplotlib installs) so
that it weighs a few tens of KB in ``docs/images/``.
"""

import os
import pathlib
import subprocess
import sys
import tempfile

from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[1]
PICTURES = {  # example -> (picture, width on the page)
    "train_step.py": ("grad_flow.png", 900),
    "gradcam.py": ("gradcam.png", 600),
    "rnn_vanishing.py": ("rnn_vanishing.png", 800),
    "attribution_patching.py": ("attribution_patching.png", 900),
    "loss_paths.py": ("loss_paths.png", 900),
    "guided_backprop.py": ("guided_backprop.png", 500),
    "layer_flow.py": ("layer_flow.png", 900),
}


def main():
    target = ROOT / "docs" / "images"
    target.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        chosen = sys.argv[1:] or list(PICTURES)
        for script in chosen:
            if script not in PICTURES:
                raise SystemExit(f"{script}: not one of the examples that draw the docs' pictures: {list(PICTURES)}")
            name, width = PICTURES[script]
            subprocess.run([sys.executable, str(ROOT / "examples" / script), "--out", tmp], check=True, env=env)
            image = Image.open(pathlib.Path(tmp) / name).convert("RGB")
            if image.width > width:
                image = image.resize((width, round(image.height * width / image.width)), Image.LANCZOS)
            small = image.quantize(colors=128, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
            small.save(target / name, optimize=True)
            print(f"wrote {target / name} ({(target / name).stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
