"""What do hybrid models (sliding-window, Mamba, linear-attention groups) get?"""
