"""Config forms for the notebooks: one widget per config field, checked by the config itself.

A form is bound both ways: `form.config` is always a valid Config, a change in a widget is
applied only when the config accepts it (else the error shows beside the field), and
`form.set(...)` or `form.config = cfg` moves the widgets.
"""

from __future__ import annotations

import dataclasses
import html
import json
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from kit.config import SECTIONS, Config, field_docs, field_section, resolve_model_path
from kit.errors import ConfigError
from kit.families import get_family
from kit.methods import get_method

# Prompts contain commas, so these lists are edited one item per line.
ONE_PER_LINE = frozenset({"validation_prompt"})

LORA_FIELDS = (
    "pretrained_model",
    "lora_rank",
    "lora_alpha",
    "learning_rate",
    "lr_scheduler",
    "lr_warmup_steps",
    "train_batch_size",
    "gradient_accumulation_steps",
    "max_train_steps",
    "mixed_precision",
    "resolution",
    "checkpointing_steps",
    "validation_steps",
    "validation_prompt",
)
"""The settings that matter most for a LoRA: notebook 04's compact form."""


def _field_type(name: str) -> tuple[Any, dataclasses.Field]:
    sec = field_section(name)
    cls = SECTIONS[sec]
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return typing.get_type_hints(cls)[name], f


def _optional(tp: Any) -> Any | None:
    """`X` when `tp` is `X | None`, else None."""
    args = typing.get_args(tp)
    if type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return None


class _Field:
    """One config field's widget, with how its value turns into config data and back."""

    def __init__(self, name: str) -> None:
        import ipywidgets as W

        self.name = name
        self.tp, f = _field_type(name)
        self.is_path = bool(f.metadata.get("path")) or name == "pretrained_model"
        doc = field_docs().get(name, "")
        style = {"description_width": "200px"}
        layout = W.Layout(width="480px")
        tp, inner = self.tp, _optional(self.tp)
        origin = typing.get_origin(tp)
        if origin is Literal:
            self.widget = W.Dropdown(options=list(typing.get_args(tp)))
        elif tp is bool:
            self.widget = W.Checkbox(indent=False)
        elif tp is int:
            self.widget = W.IntText()
        elif tp is float:
            self.widget = W.FloatText()
        elif origin is list and name in ONE_PER_LINE:
            self.widget = W.Textarea(placeholder="one per line", rows=3)
        elif origin is list:
            self.widget = W.Text(placeholder="comma-separated")
        elif dataclasses.is_dataclass(inner):
            self.widget = W.Text(placeholder='empty: none; else a JSON object, e.g. {"kind": ...}')
        elif inner is not None or tp is str:
            self.widget = W.Text(placeholder="empty: none" if inner is not None else "")
        else:
            raise ConfigError(f"{name}: no form widget for type {tp}")
        self.text = isinstance(self.widget, W.Text | W.Textarea)  # values shown as text
        self.widget.description = name
        self.widget.tooltip = doc
        self.widget.style = style
        self.widget.layout = layout
        self.error = W.HTML()
        self.help = W.HTML(
            f"<span style='color:#666;font-size:0.85em'>{html.escape(doc)}</span>",
            layout=W.Layout(width="100%"),
        )
        self.box = W.VBox([W.HBox([self.widget, self.error]), self.help])

    def to_widget(self, value: Any) -> Any:
        """The widget's value for a config value."""
        if typing.get_origin(self.tp) is list:
            sep = "\n" if self.name in ONE_PER_LINE else ", "
            return sep.join(str(v) for v in value)
        if value is None:
            return ""
        if dataclasses.is_dataclass(value):
            return json.dumps(dataclasses.asdict(value))
        return str(value) if self.text else value

    def from_widget(self, raw: Any) -> Any:
        """The config value a widget value stands for (the config checks it further)."""
        origin = typing.get_origin(self.tp)
        if origin is list:
            (item,) = typing.get_args(self.tp)
            sep = "\n" if self.name in ONE_PER_LINE else ","
            parts = [p.strip() for p in str(raw).split(sep) if p.strip()]
            return [_number(self.name, p, item) for p in parts]
        inner = _optional(self.tp)
        if dataclasses.is_dataclass(inner):
            text = str(raw).strip()
            try:
                return json.loads(text) if text else None
            except ValueError:
                raise ConfigError(f"{self.name}: expected a JSON object, got {text!r}") from None
        if inner is not None:
            text = str(raw).strip()
            return None if not text else _number(self.name, text, inner)
        if self.is_path and raw:
            # Absolute, as a loaded config holds them, so a saved file reads back the same.
            if self.name == "pretrained_model":
                return resolve_model_path(raw, Path.cwd())
            return str(Path(raw).expanduser().resolve())
        return raw

    def show_error(self, message: str) -> None:
        """Show `message` in red beside the widget (empty clears it)."""
        self.error.value = (
            f"<span style='color:#c00'>{html.escape(message)}</span>" if message else ""
        )


def _number(name: str, text: str, tp: Any) -> Any:
    """`text` read as `tp` (int, float or str), or a ConfigError naming the field."""
    if tp is str:
        return text
    try:
        return tp(text)
    except ValueError:
        kind = "an integer" if tp is int else "a number"
        raise ConfigError(f"{name}: expected {kind}, got {text!r}") from None


class ConfigForm:
    """Widgets for config fields, grouped by section, with a save button."""

    def __init__(
        self,
        cfg: Config,
        sections: Iterable[str] | None = None,
        fields: Iterable[str] | None = None,
        path: str | Path = "config.json",
    ) -> None:
        import ipywidgets as W

        self._config = cfg
        self._syncing = False
        self._pending: dict[str, Any] = {}  # fields whose shown value the config refused
        names = _select(sections, fields)
        self.fields = {n: _Field(n) for n in names}
        for f in self.fields.values():
            f.widget.value = f.to_widget(cfg.get(f.name))
            f.widget.observe(lambda change, f=f: self._changed(f, change["new"]), names="value")
        groups: dict[str, list[Any]] = {}
        for n, f in self.fields.items():
            groups.setdefault(field_section(n), []).append(f.box)
        self.sections = W.Accordion(children=[W.VBox(boxes) for boxes in groups.values()])
        for i, sec in enumerate(groups):
            self.sections.set_title(i, sec)
        self.sections.selected_index = 0
        self.path = W.Text(value=str(path), description="save to", layout=W.Layout(width="480px"))
        self.save_button = W.Button(description="save config", button_style="primary")
        self.save_button.on_click(lambda _: self._save_clicked())
        self.status = W.HTML()
        self.widget = W.VBox([self.sections, W.HBox([self.path, self.save_button]), self.status])
        self.widget.add_class("kit-config-form")

    @property
    def config(self) -> Config:
        """The current valid config."""
        return self._config

    @config.setter
    def config(self, cfg: Config) -> None:
        self._config = cfg
        self._pending.clear()
        self._sync()

    @property
    def errors(self) -> dict[str, str]:
        """Field → the config's complaint about the value its widget shows."""
        return {n: msg for n, (_, msg) in self._pending.items()}

    def set(self, name: str, value: Any) -> Config:
        """Change one field (a ConfigError when the config refuses it); the widget follows."""
        self._config = _checked(self._config.replace(**{name: value}))
        self._pending.pop(name, None)
        self._sync()
        return self._config

    def save(self, path: str | Path | None = None) -> Path:
        """Write the current config as the JSON file `kit train` reads (atomic)."""
        target = Path(path if path is not None else self.path.value).expanduser()
        self._config.save(target)
        return target

    def _save_clicked(self) -> None:
        try:
            target = self.save()
        except (OSError, ConfigError) as e:
            self.status.value = f"<span style='color:#c00'>{html.escape(str(e))}</span>"
            return
        note = f"; {len(self._pending)} field(s) in red were not applied" if self._pending else ""
        self.status.value = html.escape(f"saved {target}{note}")

    def _changed(self, f: _Field, raw: Any) -> None:
        if self._syncing:
            return
        try:
            value = f.from_widget(raw)
            self._config = _checked(self._config.replace(**{f.name: value}))
        except ConfigError as e:
            self._pending[f.name] = (raw, str(e))
            f.show_error(str(e))
            self._apply_together()
            return
        self._pending.pop(f.name, None)
        f.show_error("")
        self._retry_pending()

    def _retry_pending(self) -> None:
        """Apply refused values that the latest change made acceptable (e.g. dependent fields)."""
        for name, (raw, _) in list(self._pending.items()):
            f = self.fields[name]
            try:
                self._config = _checked(self._config.replace(**{name: f.from_widget(raw)}))
            except ConfigError as e:
                self._pending[name] = (raw, str(e))
                f.show_error(str(e))
                continue
            del self._pending[name]
            f.show_error("")
        self._apply_together()

    def _apply_together(self) -> None:
        """Apply the refused values at once: values that need each other (textual_inversion
        and its tokens, which no other method reads) are accepted together or not at all."""
        if len(self._pending) < 2:
            return
        try:
            together = {n: self.fields[n].from_widget(r) for n, (r, _) in self._pending.items()}
            self._config = _checked(self._config.replace(**together))
        except ConfigError:
            return
        for name in list(self._pending):
            del self._pending[name]
            self.fields[name].show_error("")

    def _sync(self) -> None:
        """Move every widget to the config's value (without treating that as an edit)."""
        self._syncing = True
        try:
            for name, f in self.fields.items():
                if name not in self._pending:
                    f.widget.value = f.to_widget(self._config.get(name))
                    f.show_error("")
        finally:
            self._syncing = False

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        # The widget where a front end draws it; elsewhere (papermill) the settings as text.
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        bundle["text/plain"] = "\n".join(f"{n} = {self._config.get(n)!r}" for n in self.fields)
        return bundle


def _select(sections: Iterable[str] | None, fields: Iterable[str] | None) -> list[str]:
    """Field names in config order: the named fields, else every field of the named sections."""
    if fields is not None:
        names = list(fields)
        for n in names:
            field_section(n)  # unknown names fail here, with a suggestion
        return names
    secs = list(sections) if sections is not None else list(SECTIONS)
    for s in secs:
        if s not in SECTIONS:
            raise ConfigError(f"unknown config section '{s}'; sections: {', '.join(SECTIONS)}")
    return [f.name for s in secs for f in dataclasses.fields(SECTIONS[s])]


def config_form(
    cfg: Config,
    sections: Iterable[str] | None = None,
    fields: Iterable[str] | None = None,
    path: str | Path = "config.json",
) -> ConfigForm:
    """A form for `cfg`: all fields, those of `sections`, or just `fields`; saves to `path`."""
    return ConfigForm(cfg, sections, fields, path)


def _checked(cfg: Config) -> Config:
    """`cfg`, once its method accepts it on its family (a ConfigError naming the pair if not),
    so the form refuses what training would refuse."""
    get_method(cfg, get_family(cfg.model.model_family, cfg))
    return cfg
