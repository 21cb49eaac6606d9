"""Pydantic models whose JSON schemas the structured output tests constrain generation with:
nested objects, arrays with minItems, enums, bounded integers, optional fields, anyOf, $defs.
Strings, arrays and integers are bounded, so that a random model's constrained output ends well
within max_tokens."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

Word = Annotated[str, Field(max_length=5)]
Digit = Annotated[int, Field(ge=0, le=9)]


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Flag(BaseModel):
    on: bool


class Count(BaseModel):
    n: int = Field(ge=0, le=9)


class Name(BaseModel):
    name: str = Field(min_length=1, max_length=6)


class Paint(BaseModel):
    color: Color


class Kind(BaseModel):
    kind: Literal["cat", "dog", "bird"]


class Point(BaseModel):
    x: int = Field(ge=-5, le=5)
    y: int = Field(ge=-5, le=5)


class Segment(BaseModel):
    start: Point
    end: Point


class Tags(BaseModel):
    tags: list[Word] = Field(min_length=1, max_length=3)


class Scores(BaseModel):
    scores: list[Annotated[int, Field(ge=0, le=99)]] = Field(min_length=2, max_length=4)


class MaybeAge(BaseModel):
    age: int | None = Field(default=None, ge=0, le=120)


class Address(BaseModel):
    city: str = Field(max_length=8)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=8)
    address: Address
    nickname: str | None = Field(default=None, max_length=5)


class Team(BaseModel):
    lead: Person
    size: int = Field(ge=1, le=12)


class Polyline(BaseModel):
    points: list[Point] = Field(min_length=1, max_length=3)


class Circle(BaseModel):
    shape: Literal["circle"]
    radius: int = Field(ge=1, le=10)


class Square(BaseModel):
    shape: Literal["square"]
    side: int = Field(ge=1, le=10)


class Drawing(BaseModel):
    item: Circle | Square


class IdOrName(BaseModel):
    ref: Annotated[int, Field(ge=0, le=999)] | Word


class Node(BaseModel):
    label: str = Field(max_length=4)
    child: Leaf | None = None


class Leaf(BaseModel):
    value: int = Field(ge=0, le=50)


class Palette(BaseModel):
    colors: list[Color] = Field(min_length=1, max_length=3)
    default: Color


class Settings(BaseModel):
    verbose: bool
    level: Literal[1, 2, 3]
    mode: Literal["fast", "slow"] | None = None


class Inventory(BaseModel):
    items: list[Name] = Field(min_length=1, max_length=2)
    total: int = Field(ge=0, le=100)


class Matrix(BaseModel):
    rows: list[Annotated[list[Digit], Field(min_length=1, max_length=2)]] = Field(
        min_length=1, max_length=2
    )


class Event(BaseModel):
    title: str = Field(max_length=8)
    where: Address | None = None
    attendees: list[Name] = Field(min_length=1, max_length=2)
    kind: Kind


Node.model_rebuild()

MODELS: list[type[BaseModel]] = [
    Flag,
    Count,
    Name,
    Paint,
    Kind,
    Point,
    Segment,
    Tags,
    Scores,
    MaybeAge,
    Address,
    Person,
    Team,
    Polyline,
    Drawing,
    IdOrName,
    Node,
    Palette,
    Settings,
    Inventory,
    Matrix,
    Event,
]
