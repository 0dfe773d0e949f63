"""
The baselines of the xPRT paper, as their authors run them, one file each: retromae.py, simlm.py, contriever.py
(with random spans), revela.py, and self_reconstruction.py (the paper's Table 3 ablation); shared.py holds what they
share (the two settings, whole-word masking, the anchor collator). This file holds no code.

The paper compares xPRT with established objectives ("Experiments": "the five baselines use their official
implementations"). Each is one class over modeling_xprt.Objective, registered as an --objective of train.py, run under
the same flags, data, steps, batch, schedule and retention term as xPRT; each is written from its authors' code (read,
not copied), one function per equation, with the official numbers:
  RetroMAE  staoxiao/RetroMAE         src/pretrain/{modeling,enhancedDecoder,data,arguments}.py, examples/pretrain
  SimLM     microsoft/unilm           simlm/src/{models/rlm.py, collators/rlm_collator.py, collators/collator_utils.py,
                                      config.py}, simlm/scripts/train_rlm.sh
  Contriever facebookresearch/contriever  src/{data.py, inbatch.py, moco.py, contriever.py, options.py}, README's
                                      training command
  Revela    TRUMANCFY/Revela + TRUMANCFY/transformers (branch adapt): revela.py
  --objective retromae | simlm | contriever | revela; and, kept from before:
  contrastive_random_span  two random crops of one passage as a positive pair, cosine InfoNCE over in-batch
                           negatives (crops of >= 1 token, no word deletion, the longer crop as the query): Contriever's
                           cropping alone; how it differs from Contriever's code is listed in contriever.py, section 2
  self_reconstruction      the paper's Table 3 ablation: xPRT's own conditioned decoder rebuilds a passage from that
                           passage's own vector (no related passages)

Two settings (--baseline_setting; the one table of what each changes: BASELINE_SETTINGS below):
  official  each baseline as its authors' code runs it: RetroMAE and SimLM condition their decoders on the encoder's
            last-layer [CLS] state and the saved folder pools [CLS] (so evaluate.py scores the vector that was
            trained); Contriever scores dot products of unnormalised mean-pooled vectors / 0.05 against the MoCo
            queue of a momentum encoder (the README's run) and its folder scores by dot product without Normalize;
            SimLM's frozen generator samples in train mode (dropout on).
  paper     the shared setting of the comparison (the default): every arm pooled and scored as the start model is
            (E5: mean pooling, cosine), in-batch negatives, the generator without dropout.
Both settings mask as the official collators do ([UNK] never masked: never_unk). The setting is recorded in the
saved folder (xprt_config.json "heads": baseline_setting; its pooling and similarity in the sentence-transformers
files and xprt_config.json "info").

What the paper's setting changes, for every arm (choices the official code does not make are marked "ours"):
  - The text an arm trains on is the anchor passage of each group (select_groups.py, 128 tokens), as the paper gives
    every method the same groups, steps and batch; the official runs read their own corpora (RetroMAE: Wikipedia +
    BookCorpus at 512 tokens; SimLM: MS MARCO passages at 144; Contriever: 256-token chunks of a token stream that
    runs across documents). Contriever's crops are therefore 10-50% of a passage, not of a 256-token chunk.
  - Every arm pools as the start model does (XPRTModel.encode: mean pooling for E5): RetroMAE and SimLM condition their
    decoders on that vector (fp32 mean, cast to the weights' dtype) in place of the [CLS] state; Contriever's
    "average" pooling is the same mean.
  - Every arm gets the same retention term (XPRTModel's, on the clean anchor and s1: the collators emit its fields).
  - ours: the passage prefix E5 reads ("passage: ") is kept in every input and is never masked, replaced, cropped or
    a prediction target (it is the same in every passage; the official code has no prefix). The masking budget counts
    what the official code counts: [CLS] + the passage + [SEP], not the prefix.
  - SimLM's generator must share the start model's vocabulary (google/electra-base-generator has bert-base-uncased's
    30,522 words, as E5 and MiniLM do); it is checked at start.

Departures from the official code (each named where it is made):
  - RetroMAE: the decoder's per-row attention masks are drawn on the device, in the training step, by the same rule
    (enhanced_decoding_masks), instead of in the data loader with Python lists; the same distribution, other draws.
  - SimLM (paper setting): the frozen generator runs in eval mode (no dropout). In the official code it is a
    registered submodule of the trained model, so the Trainer's model.train() turns its dropout back on after
    `generator.eval()` (rlm.py line 40); the official setting does the same.
  - Contriever: its negatives are --contrastive_mode's (contriever.py, section 1): moco in the official
    setting, the README's run (options.py's default mode: a queue of 65,536 keys, as the README's flags parse
    (its --moco_queue is no flag of options.py; example_scripts pass --queue_size 131072); momentum 0.9995 as
    example_scripts pass; no gradient through the keys), in-batch (src/inbatch.py) in the paper setting,
    either by the flag in both. In the paper setting its scores follow the start model's similarity (ours):
    cosines for a cosine start (E5, MiniLM: dot products put MiniLM's logits in the hundreds and its loss
    climbed from 0.6 to 7 in 20 demo steps).
    MoCo here: the key encoder is kept in fp32 (a bf16 copy would lose the 0.0005 steps), the queue's first random
    keys come from a generator of the run's seed (moco.py: the global one), and under gradient accumulation each
    micro-batch updates and enqueues (its train.py has no accumulation; Contriever's docstring).
"""
