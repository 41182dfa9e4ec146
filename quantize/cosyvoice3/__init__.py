"""Build-host side of the Fun-CosyVoice3 family: official release -> torch reference modules (-> bundle later)."""
