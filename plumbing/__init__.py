"""The plumbing below the paper scripts: what no paper step owns, one room per concern, importing none of the step
scripts (select_groups.py, train.py, finetune.py, evaluate.py) or the arms (baselines/).
  common.py         user errors and flag types, model names and prefixes, output folders and atomic writes, devices
  readers.py        select_groups.py's input: JSON Lines, parquet, saved datasets, the Hub; each record's file:line
  batches.py        samplers (length-grouped, one document capped per batch), seeded collation in the loader's workers
  run_log.py        the log window, FLOPs and MFU, the memory estimate, the loss curve
  model_folder.py   what a model folder records, save and load (the XPRTModel folder), the start's loaders, the card
  training.py       the pieces both training loops call: the accelerator, the model and optimiser for a run,
                    checkpoints, resume and stop signals, the shared flags
  architectures.py  any encoder taken apart, the vocabulary terms chunk by chunk: modeling_xprt.py's companion, which
                    imports no file of the repository
modeling_xprt.py (the model) stands under them: model_folder.py saves and loads it, training.py builds it.
"""
