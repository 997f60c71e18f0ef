"""A request's chat messages as the prompt: their images loaded, then the app's chat format's token ids.

Used by /v1/chat/completions and by /tokenize with ``messages``, so both count the same tokens.  Blocking (image
URLs are fetched): call from the request's worker thread.  Every refusal is a 400 (``APIError``).
"""

from __future__ import annotations

import logging

from .chat import ChatImage
from .errors import bad_request
from .images import ImageError, chat_image, find_image_urls, load_images
from .state import ServerState

log = logging.getLogger("kimi_jax.serve")


def encode_messages(st: ServerState, messages, tools, opts, add_generation_prompt=True, images=()) -> list[int]:
    """``messages`` (with ``tools`` and the format's ``opts``) -> prompt ids in ``st.chat_format``, which must be
    set; ``images`` are ``message_images``' ``ChatImage`` list."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages", "invalid_type")
    try:
        return st.chat_format.encode(messages, tools, opts, add_generation_prompt=add_generation_prompt,
                                     images=images)
    except ValueError as e:  # the chat encoder's own words about the messages
        raise bad_request(f"messages: {e}", "messages") from None
    except (KeyError, TypeError):  # a shape the encoder did not expect: its text would be Python's, not ours
        log.info("messages the chat encoder could not read", exc_info=True)
        raise bad_request("messages: a message has an unexpected shape (each needs a 'role' and a 'content' "
                          "string or list of parts)", "messages") from None


def message_images(st: ServerState, messages) -> tuple[list, list[ChatImage]]:
    """The user messages' images, decoded (uint8 RGB arrays) and as the prompt sees them; ([], []) without
    any.  Refused with a 400 where this model or chat format cannot take images, or an image is unusable."""
    try:
        urls = find_image_urls(messages)
    except ImageError as e:
        raise bad_request(f"messages: {e}", "messages") from None
    if not urls:
        return [], []
    if getattr(st.engine.model, "vision", None) is None:
        raise bad_request(f"the model `{st.model_name}` has no vision tower: image parts are not supported "
                          f"({urls[0][0]})", "messages", "unsupported")
    if st.chat_format is None or st.chat_format.name != "k3":
        name = st.chat_format.name if st.chat_format is not None else "none"
        raise bad_request(f"the {name} chat format has no image form; images need the K3 chat format "
                          f"({urls[0][0]})", "messages", "unsupported")
    try:
        arrays = load_images(urls, st.image_fetch)
    except ImageError as e:
        raise bad_request(f"messages: {e}", "messages", "invalid_image") from None
    vision_cfg = st.engine.model.config.vision
    return arrays, [chat_image(a, vision_cfg) for a in arrays]
