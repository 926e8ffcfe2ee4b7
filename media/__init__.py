"""Attachments turned into model input: documents into text, images into checked pixels."""
