"""Train a small byte-level BPE tokenizer (Hugging Face `tokenizers`) on text files; writes tokenizer.json.

Usage: python train_tokenizer.py CORPUS.txt [MORE.txt ...] --out tokenizer.json [--vocab-size 512]
"""

import argparse

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("files", nargs="+")
ap.add_argument("--out", required=True)
ap.add_argument("--vocab-size", type=int, default=512)
args = ap.parse_args()

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train(args.files, trainer)
tok.save(args.out)
print(f"{args.out}: {tok.get_vocab_size()} tokens")
