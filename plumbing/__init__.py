"""The plumbing below the paper scripts, one room per concern (the README's map says which), importing no step script
and no arm; modeling_xprt.py stands under it. architectures.py, the model's one companion, imports no file at all."""
