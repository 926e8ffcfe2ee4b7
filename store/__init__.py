"""SQLite persistence: organisations, API keys, conversations, files and the usage ledger.

`Store` (store/store.py, with store/store_conversations.py) is the only object that runs SQL; its
value types live in store/types.py.
"""
