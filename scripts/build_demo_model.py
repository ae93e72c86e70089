#!/usr/bin/env python
"""Train the demo BPE tokenizer and save a fresh small T5 model (no network).

Usage (from the repository root, after scripts/make_demo_data.py):

    python scripts/build_demo_model.py --data_dir data/demo --out_dir models/demo-t5

Options: --vocab_size 2000 --d_model 128 --d_ff 512 --num_layers 2
--num_decoder_layers N --num_heads 4 --d_kv 32 --dropout_rate 0.0 --seed 0
"""

import sys

from trainer_shard.demo import build_demo_model_main

if __name__ == "__main__":
    sys.exit(build_demo_model_main())
