"""Head training (installed as ``treespec.heads.training``): it drives the engine, so it sits
above it, while the head modules in ``treespec.heads`` sit below the proposers that use them.

- ``data``: self-distilled data (the target's answers and hidden states, in shards);
- ``train``: the losses, the training loop and the acceptance (tau) measured through the engine;
- ``prompts``: the train and dev prompts.

Nothing is imported here, and ``treespec.heads`` never imports this package.
"""
