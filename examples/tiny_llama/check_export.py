"""Load an exported model folder with transformers and score the first 256 tokens of a token file.

Usage: python check_export.py MODEL_FOLDER TOKENS.npy
"""

import sys

import numpy as np
import torch
import transformers

folder, tokens = sys.argv[1], sys.argv[2]
model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
ids = torch.from_numpy(np.load(tokens, mmap_mode="r")[:257].astype(np.int64))[None]
with torch.no_grad():
    loss = model(ids, labels=ids).loss.item()  # transformers shifts the labels itself
print(f"{type(model).__name__}: {model.num_parameters():,} parameters, loss {loss:.3f} nats/token on the first 256 tokens")
