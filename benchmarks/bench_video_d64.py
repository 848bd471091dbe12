"""`python -m sparsepatch bench video_d64 [options]`: the skip-list quality-vs-speed sweep on the trained d64 video
denoiser (benchmarks/sweep_tiny_video_d64.py; its --help has the options)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sweep_tiny_video_d64 import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
