"""The offline demo's world: toy images, the toy base model, the judge, the learning report."""
