"""The data side of training: corpora on disk, replay plans, the stream a training step reads, SFT sets.

Rooms, in the direction the data flows (an arrow is "may import"):
``formats`` (shard, manifest, tokenizer and layout files) <- ``build`` (tokenize, merge, publish) and
``plans`` (schema, build, correct, budget) <- ``stream`` (store, node cache, reader); ``sft`` reads
``formats``. ``commands`` and ``embedded`` (the demo corpus) sit on top, and ``stage`` above them is
training's one door: ``open_stage_data`` and the ``DataLoader`` it returns. ``config`` declares the
config's ``data:`` section. No room imports training.
"""
