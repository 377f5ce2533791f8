"""The files a corpus is made of and their validation: uint16 token shards, source and mixture
manifests, the two corpus layouts, the tokenizer and its hash, typed reads of untrusted JSON.
Imports nothing of the data package outside this room (only ``ds_trhash.errors``, ``io``, ``safe_names``).
"""
