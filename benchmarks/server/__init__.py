"""What does the plugin cost an API server's requests?"""
