"""How much of the LRU-to-Belady gap do idles, predicted returns and the picker close, and is
the plugin ever worse than vanilla?"""
