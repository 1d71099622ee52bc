# >>> ch09 file: speculative decoding
"""Speculative decoding with the MTP drafter, in one package above the engine (it imports the engine,
never the other way): the plain engine's files hold no step of it.

    runner.py        SpecRunner: the model runner that speculates (draft, verify, accept, draft extend)
    accept.py        the accept rule, greedy and sampled, on the device
    verify_batch.py  the verify step's batch and the KV slots reserved for its window (chapter 11)
    relay.py         what a step hands the next, on the device, per request slot (chapter 10)
    graphs.py        the verify step's three CUDA graphs (chapter 13)
"""
