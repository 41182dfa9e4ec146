"""VITS (Piper) voices: pipeline.py (runtime), convert.py (Piper voice -> bundle, torch-free), default_voice.py
(the embedded voice, converted on first use)."""
