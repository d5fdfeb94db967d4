"""Recipes (`zerotrain train --config NAME|FILE`), shipped as package data of `zerotrain.recipes`."""
